"""Input and prediction drift against the reference statistics written by `validate`.

PSI compares histograms over the reference's bin edges; KS compares the live empirical CDF with
the reference CDF interpolated from its stored quantiles. Both are computed per feature and
averaged per feature group (image rows, table columns), over a sliding window of live inputs.
"""

from __future__ import annotations

import logging
import math
import threading
from collections import Counter as TokenCounter
from collections import deque
from dataclasses import dataclass

import numpy as np

from pruneops.core.errors import DataError

EPS = 1e-4
# One-sided 99 %: a window of inputs drawn from the reference itself scores under the thresholds
# 99 times in 100, so an alert on a full window is drift, not sampling noise.
NOISE_Z = 2.326
KS_CRITICAL_1PCT = 1.628  # Kolmogorov: P(sqrt(n) D > 1.628) = 1 % for large n

log = logging.getLogger("pruneops.data.drift")


def chi2_quantile(dof: int, z: float = NOISE_Z) -> float:
    """The chi-square quantile at standard-normal score `z` (Wilson-Hilferty; within 1 % from 3 dof)."""
    k = max(dof, 1)
    return k * (1 - 2 / (9 * k) + z * math.sqrt(2 / (9 * k))) ** 3


def noise_bounded_samples(ref_hist: np.ndarray, psi_threshold: float, ks_threshold: float) -> int:
    """The fewest live samples whose PSI and KS stay under the thresholds on in-distribution inputs.

    With n samples from the reference distribution, a feature's PSI is about chi-square with
    (occupied bins - 1) degrees of freedom over n, and its KS D about Kolmogorov's over sqrt(n);
    the count is taken at the 99th percentile of the feature with the most occupied bins, so
    the averages the alerts read are bounded as well.
    """
    occupied = int((np.asarray(ref_hist) > EPS).sum(axis=-1).max()) if np.size(ref_hist) else 1
    n_psi = chi2_quantile(occupied - 1) / psi_threshold
    n_ks = (KS_CRITICAL_1PCT / ks_threshold) ** 2
    return int(math.ceil(max(n_psi, n_ks)))


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


def _finite(reference: dict, key: str, ndim: int) -> np.ndarray:
    value = np.asarray(reference[key], dtype=np.float64)
    if value.ndim != ndim or not np.isfinite(value).all():
        raise ValueError(f"reference statistics: {key!r} must be a finite {ndim}-d array, got shape {value.shape}")
    return value


def parse_reference(reference: dict) -> tuple:
    """Checks reference statistics for consistency and returns them as arrays.

    Returns:
        (bin edges, histograms, quantile levels, quantiles, classes, class frequencies, groups).

    Raises:
        ValueError: A key is missing, or a shape, value or index does not fit the others.
    """
    try:
        edges = _finite(reference, "bin_edges", 1)
        hist = _finite(reference, "histograms", 2)
        levels = _finite(reference, "quantile_levels", 1)
        quantiles = _finite(reference, "quantiles", 2)
        freq = _finite(reference, "class_frequencies", 1)
        classes = [int(c) for c in reference["classes"]]
        groups = {str(n): np.asarray(idx, dtype=np.int64) for n, idx in dict(reference["feature_groups"]).items()}
    except (KeyError, TypeError, ValueError, OverflowError) as exc:
        raise ValueError(f"reference statistics: malformed ({type(exc).__name__}: {exc})") from None
    n_features = hist.shape[0]
    problems = [
        (len(edges) < 2 or hist.shape[1] != len(edges) - 1, "histograms do not match bin_edges"),
        (quantiles.shape != (n_features, len(levels)), "quantiles do not match quantile_levels and features"),
        (len(freq) != len(classes), "class_frequencies do not match classes"),
        (any(i.size == 0 or i.min() < 0 or i.max() >= n_features for i in groups.values()), "bad feature index"),
    ]
    for bad, what in problems:
        if bad:
            raise ValueError(f"reference statistics: {what}")
    return edges, hist, levels, quantiles, classes, freq, groups


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
        min_samples: No scores below this many samples; None derives it from the reference's
            bins and the thresholds (`noise_bounded_samples`), since a handful of inputs makes
            PSI noisy enough to raise false alerts.
        psi_threshold: The PSI the alerts compare with (for the derived sample size).
        ks_threshold: The KS statistic the alerts compare with.
    """

    def __init__(
        self,
        reference: dict | None,
        window: int = 1000,
        min_samples: int | None = None,
        psi_threshold: float = 0.2,
        ks_threshold: float = 0.3,
    ):
        self.explicit_min_samples = min_samples
        self.min_samples = min_samples or 1
        self.window = window
        self.thresholds = (psi_threshold, ks_threshold)
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

        Raises:
            ValueError: The statistics are malformed (the current reference is kept).
        """
        parsed = parse_reference(reference)
        with self._lock:
            self.reference = reference
            self.edges, self.ref_hist, self.levels, self.quantiles, self.classes, self.class_freq, self.groups = parsed
            self._inputs.clear()
            self._preds.clear()
            self.min_samples = self.explicit_min_samples or noise_bounded_samples(self.ref_hist, *self.thresholds)
        if self.min_samples > self.window:
            log.error(
                "drift is not scored: %d samples are needed for scores above sampling noise, the window keeps %d "
                "(raise serve.drift_window)",
                self.min_samples,
                self.window,
            )

    @property
    def samples(self) -> int:
        """Inputs in the window now."""
        return len(self._inputs)

    def observe(self, x: np.ndarray, predictions: np.ndarray) -> None:
        """Adds a batch of model inputs (any shape per sample) and their predicted classes."""
        flat = np.asarray(x, dtype=np.float32).reshape(len(x), -1)
        with self._lock:
            if self.reference is not None and flat.shape[1] != self.ref_hist.shape[0]:
                return  # another input shape than the reference describes: nothing to compare with
            self._inputs.extend(flat)
            self._preds.extend(int(p) for p in predictions)

    def scores(self) -> DriftScores | None:
        """Drift of the current window, or None without a reference or below `min_samples`."""
        with self._lock:
            if self.reference is None or len(self._inputs) < self.min_samples:
                return None
            x = np.stack(self._inputs)
            preds = np.asarray(self._preds)
            # One consistent reference even if `set_reference` runs while this scores.
            edges, ref_hist, levels, quantiles, classes, class_freq, groups = (
                self.edges,
                self.ref_hist,
                self.levels,
                self.quantiles,
                self.classes,
                self.class_freq,
                self.groups,
            )
        feature_psi = psi(ref_hist, histograms(x, edges))
        feature_ks = ks_against_quantiles(x, levels, quantiles)
        live_freq = np.array([(preds == c).mean() for c in classes])
        return DriftScores(
            psi_by_group={g: float(feature_psi[idx].mean()) for g, idx in groups.items()},
            ks_by_group={g: float(feature_ks[idx].mean()) for g, idx in groups.items()},
            psi_overall=float(feature_psi.mean()),
            ks_overall=float(feature_ks.mean()),
            prediction_psi=float(psi(class_freq, live_freq)),
            window=len(x),
        )


# Text drift is measured on per-text features scaled to [0, 1], so the same histograms, PSI and KS
# serve: how much of `max_length` a text fills, and the share of its tokens the vocabulary lacks.
TEXT_FEATURE_GROUPS = {"token_length": [0], "unknown_token_rate": [1]}


def text_drift_features(ids: np.ndarray, mask: np.ndarray, max_length: int, unknown_id: int | None) -> np.ndarray:
    """Per text: real tokens / `max_length` and unknown tokens / real tokens, shape (texts, 2).

    Args:
        ids: Token ids, shape (texts, length).
        mask: Attention mask of the same shape (1 for real tokens).
        max_length: The data's tokenised length (a truncated text fills it).
        unknown_id: The tokenizer's unknown-token id (None: no unknown tokens are counted).
    """
    real = np.asarray(mask).astype(bool)
    length = real.sum(axis=1)
    unknown = ((np.asarray(ids) == unknown_id) & real).sum(axis=1) if unknown_id is not None else np.zeros(len(ids))
    return np.stack([np.minimum(length / max(max_length, 1), 1.0), unknown / np.maximum(length, 1)], axis=1).astype(
        np.float32
    )


TOP_TOKENS = 63  # reference tokens with a bin of their own; every other token shares one


def prompt_reference(token_lists: list[list[int]]) -> dict:
    """The reference of prompt drift: the most frequent tokens of a corpus and every bin's share."""
    counts = TokenCounter(t for tokens in token_lists for t in tokens)
    total = sum(counts.values())
    if not total:
        raise DataError("the drift reference corpus holds no tokens")
    top = [t for t, _ in counts.most_common(TOP_TOKENS)]
    shares = [counts[t] / total for t in top]
    return {"tokens": top, "shares": [*shares, max(0.0, 1.0 - sum(shares))], "total": total}
