"""Input and prediction drift against the reference statistics written by `validate`.

PSI compares histograms over the reference's bin edges; KS compares the live empirical CDF with
the reference CDF interpolated from its stored quantiles. Both are computed per feature and
averaged per feature group (image rows, table columns), over a sliding window of live inputs.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass

import numpy as np

EPS = 1e-4


def psi(expected: np.ndarray, actual: np.ndarray, eps: float = EPS) -> np.ndarray:
    """Population stability index per row: sum((a - e) * ln(a / e)) over bins.

    Args:
        expected: Reference bin frequencies, shape (..., bins), rows summing to 1.
        actual: Live bin frequencies of the same shape.
        eps: Floor for empty bins (an empty bin would make the log infinite).
    """
    e = np.clip(np.asarray(expected, dtype=np.float64), eps, None)
    a = np.clip(np.asarray(actual, dtype=np.float64), eps, None)
    return ((a - e) * np.log(a / e)).sum(axis=-1)


def histograms(x: np.ndarray, edges: np.ndarray) -> np.ndarray:
    """Per-feature bin frequencies of `x` (samples, features) over shared `edges`."""
    bins = len(edges) - 1
    idx = np.clip(np.searchsorted(edges, x, side="right") - 1, 0, bins - 1)
    counts = np.zeros((x.shape[1], bins))
    np.add.at(counts, (np.broadcast_to(np.arange(x.shape[1]), idx.shape), idx), 1)
    return counts / max(len(x), 1)


def ks_against_quantiles(x: np.ndarray, levels: np.ndarray, quantiles: np.ndarray) -> np.ndarray:
    """Kolmogorov-Smirnov D per feature: max |F_live - F_ref| with F_ref from quantiles.

    Args:
        x: Live samples, shape (samples, features).
        levels: Quantile levels of the reference, ascending in [0, 1].
        quantiles: Reference quantiles, shape (features, levels).
    """
    out = np.empty(x.shape[1])
    for j in range(x.shape[1]):
        sample = np.sort(x[:, j])
        q = quantiles[j]
        # Evaluate both CDFs at every live point and every reference knot.
        points = np.concatenate([sample, q])
        live = np.searchsorted(sample, points, side="right") / len(sample)
        ref = np.interp(points, q, levels, left=0.0, right=1.0)
        out[j] = float(np.abs(live - ref).max())
    return out


@dataclass(frozen=True)
class DriftScores:
    """PSI and KS per feature group, overall scores, and prediction drift."""

    psi_by_group: dict[str, float]
    ks_by_group: dict[str, float]
    psi_overall: float
    ks_overall: float
    prediction_psi: float
    window: int


class DriftMonitor:
    """Sliding window of live inputs and predictions, scored against reference statistics.

    Args:
        reference: The `reference_stats.json` mapping written by `validate`; None scores nothing
            until `set_reference` gives one.
        window: How many recent samples to keep.
        min_samples: No scores below this many samples: a handful of inputs makes PSI noisy
            enough to raise false alerts.
    """

    def __init__(self, reference: dict | None, window: int = 1000, min_samples: int = 50):
        self.min_samples = min_samples
        self.reference: dict | None = None
        self._inputs: deque[np.ndarray] = deque(maxlen=window)
        self._preds: deque[int] = deque(maxlen=window)
        self._lock = threading.Lock()
        if reference is not None:
            self.set_reference(reference)

    def set_reference(self, reference: dict) -> None:
        """Scores against `reference` from now on; the window restarts empty.

        A model re-pruned on new data brings that data's statistics: measuring it against the
        old reference would keep the drift alert firing after the re-prune that answered it.
        """
        with self._lock:
            self.reference = reference
            self.edges = np.asarray(reference["bin_edges"], dtype=np.float64)
            self.ref_hist = np.asarray(reference["histograms"], dtype=np.float64)
            self.levels = np.asarray(reference["quantile_levels"], dtype=np.float64)
            self.quantiles = np.asarray(reference["quantiles"], dtype=np.float64)
            self.classes = list(reference["classes"])
            self.class_freq = np.asarray(reference["class_frequencies"], dtype=np.float64)
            self.groups = {name: np.asarray(idx) for name, idx in reference["feature_groups"].items()}
            self._inputs.clear()
            self._preds.clear()

    def observe(self, x: np.ndarray, predictions: np.ndarray) -> None:
        """Adds a batch of model inputs (any shape per sample) and their predicted classes."""
        flat = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
        with self._lock:
            self._inputs.extend(flat)
            self._preds.extend(int(p) for p in predictions)

    def scores(self) -> DriftScores | None:
        """Drift of the current window, or None without a reference or below `min_samples`."""
        with self._lock:
            if self.reference is None or len(self._inputs) < max(self.min_samples, 1):
                return None
            x = np.stack(self._inputs)
            preds = np.asarray(self._preds)
        feature_psi = psi(self.ref_hist, histograms(x, self.edges))
        feature_ks = ks_against_quantiles(x, self.levels, self.quantiles)
        psi_by_group = {g: float(feature_psi[idx].mean()) for g, idx in self.groups.items()}
        ks_by_group = {g: float(feature_ks[idx].mean()) for g, idx in self.groups.items()}
        live_freq = np.array([(preds == c).mean() for c in self.classes])
        return DriftScores(
            psi_by_group=psi_by_group,
            ks_by_group=ks_by_group,
            psi_overall=float(feature_psi.mean()),
            ks_overall=float(feature_ks.mean()),
            prediction_psi=float(psi(self.class_freq, live_freq)),
            window=len(x),
        )
