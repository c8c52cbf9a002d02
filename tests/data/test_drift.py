import numpy as np
import pytest
from scipy import stats

from pruneops.core.io import Layout, read_json
from pruneops.data import load_prepared
from pruneops.data.drift import DriftMonitor, histograms, ks_against_quantiles, psi
from pruneops.task.classification.validate import ValidateConfig, validate_dataset


def test_psi_matches_hand_computation():
    expected, actual = np.array([0.5, 0.5]), np.array([0.9, 0.1])
    by_hand = (0.9 - 0.5) * np.log(0.9 / 0.5) + (0.1 - 0.5) * np.log(0.1 / 0.5)
    assert float(psi(expected, actual)) == pytest.approx(by_hand, rel=1e-9)
    assert float(psi(expected, expected)) == 0.0
    # An empty bin is floored, not infinite.
    assert np.isfinite(psi(np.array([1.0, 0.0]), np.array([0.0, 1.0])))


def test_histograms_match_numpy():
    x = np.random.default_rng(0).random((500, 3))
    edges = np.linspace(0, 1, 11)
    ours = histograms(x, edges)
    for j in range(3):
        ref, _ = np.histogram(x[:, j], bins=edges)
        np.testing.assert_allclose(ours[j], ref / 500)


@pytest.mark.parametrize("shift", [0.0, 0.1, 0.3])
def test_ks_from_quantiles_agrees_with_scipy(shift):
    rng = np.random.default_rng(1)
    reference = rng.normal(size=20_000)
    live = rng.normal(loc=shift, size=400)
    levels = np.linspace(0, 1, 201)
    quantiles = np.quantile(reference, levels)[None, :]
    ours = float(ks_against_quantiles(live[:, None], levels, quantiles)[0])
    theirs = stats.ks_2samp(live, reference).statistic
    assert ours == pytest.approx(theirs, abs=0.01)


def test_monitor_flags_shifted_inputs_and_collapsed_predictions(tmp_path):
    report = validate_dataset(ValidateConfig(), Layout(tmp_path))
    reference = read_json(report.data_dir / "reference_stats.json")
    _, _, _, test = load_prepared(report.data_dir)
    monitor = DriftMonitor(reference, window=300, min_samples=50)
    assert monitor.scores() is None
    monitor.observe(test.x[:49], test.y[:49])
    assert monitor.scores() is None  # too few samples to judge
    monitor.observe(test.x[:300], test.y[:300])
    calm = monitor.scores()
    assert calm.window == 300 and calm.psi_overall < 0.1 and calm.prediction_psi < 0.05
    assert set(calm.psi_by_group) == {f"row_{r:02d}" for r in range(8)}
    shifted = np.clip(test.x[:300] * 0.3 + 0.6, 0, 1)
    monitor.observe(shifted, np.zeros(300, dtype=int))  # the window now holds only shifted inputs
    drift = monitor.scores()
    assert drift.psi_overall > 1.0 > 10 * calm.psi_overall
    assert drift.ks_overall > 0.5 > 5 * calm.ks_overall
    assert drift.prediction_psi > 1.0
