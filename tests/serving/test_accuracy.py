"""The accuracy alert's threshold: sampling noise alone stays above it, a real drop falls below."""

import numpy as np
import pytest

from pruneops.serving.accuracy import accuracy_threshold, expected_accuracy


@pytest.mark.parametrize(
    ("accuracy", "held_out", "window", "drop"),
    # The drop each case can see: the tolerance plus about 5.3 standard errors of the difference.
    [(0.78, 400, 500, 0.16), (0.95, 2000, 500, 0.07), (0.99, 10_000, 2000, 0.03)],
)
def test_an_unchanged_model_stays_above_the_threshold_and_a_real_drop_falls_below(accuracy, held_out, window, drop):
    rng = np.random.default_rng(0)
    threshold = accuracy_threshold((accuracy, held_out), window, tolerance=0.005)
    # The held-out figure itself is a sample: draw it as well as the window.
    measured = rng.binomial(held_out, accuracy, 20_000) / held_out
    thresholds = [accuracy_threshold((m, held_out), window, 0.005) for m in measured[:2000]]
    thresholds = np.array([-np.inf if t is None else t for t in thresholds])  # None: no alert possible
    unchanged = rng.binomial(window, accuracy, 2000) / window
    assert np.mean(unchanged < thresholds) < 0.01  # false alarms from noise alone
    dropped = rng.binomial(window, accuracy - drop, 2000) / window
    assert np.mean(dropped < threshold) > 0.99


def test_no_threshold_without_a_held_out_figure_or_before_the_window_can_judge():
    assert expected_accuracy({}) is None
    assert expected_accuracy({"metrics": {"models": {"pruned_deployed": {"test_accuracy": 1.5}}}}) is None
    assert accuracy_threshold(None, 500, 0.005) is None
    assert accuracy_threshold((0.78, 400), 29, 0.005) is None  # fewer than 30 labels
    assert accuracy_threshold((0.99, 0), 400, 0.005) is None  # fewer than 5 expected errors
    assert accuracy_threshold((0.99, 0), 500, 0.005) is not None
