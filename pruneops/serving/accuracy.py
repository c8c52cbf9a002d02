"""The accuracy alert's threshold, from the served model's own held-out accuracy and the window's noise."""

from __future__ import annotations

# How far below the served model's test accuracy the rolling accuracy may fall from sampling
# noise alone, in standard errors: at 3, a model that has not changed raises no accuracy alert
# (one-sided 0.13 % per evaluation).
ACCURACY_ALERT_Z = 3.0


def expected_accuracy(metadata: dict) -> tuple[float, int] | None:
    """The served model's accuracy on held-out data and over how many samples, from its benchmark metrics."""
    deployed = (metadata.get("metrics") or {}).get("models", {}).get("pruned_deployed", {})
    accuracy = deployed.get("test_accuracy")
    if not isinstance(accuracy, int | float) or not 0 < accuracy <= 1:
        return None
    samples = deployed.get("test_samples")
    return float(accuracy), int(samples) if isinstance(samples, int) and samples > 0 else 0


def accuracy_threshold(expected: tuple[float, int] | None, window: int, tolerance: float) -> float | None:
    """The rolling accuracy below which the model has changed, not just the sample.

    Its held-out accuracy minus the tolerance and `ACCURACY_ALERT_Z` standard errors of the
    difference between a `window` of labels and the held-out figure (its own sample included
    where its size is known). None without a held-out figure, or while the window is too small
    for that normal approximation (fewer than 30 labels, or than 5 expected errors).
    """
    if expected is None:
        return None
    accuracy, held_out = expected
    if window < max(30, 5 / max(1 - accuracy, 1e-6)):
        return None
    variance = accuracy * (1 - accuracy) * (1 / window + (1 / held_out if held_out else 0))
    return accuracy - tolerance - ACCURACY_ALERT_Z * variance**0.5
