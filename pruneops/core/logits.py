"""Next-token losses from a causal LM's logits (numpy, float64): one rule for every runtime's scoring."""

from __future__ import annotations

import numpy as np


def token_nll(logits: np.ndarray, targets: np.ndarray) -> np.ndarray:
    """The negative log-likelihood of `targets[i]` under the softmax of `logits[i]`.

    Args:
        logits: (n, vocab) logits, any float type (computed in float64).
        targets: (n,) token ids.

    Returns:
        (n,) losses.
    """
    logits = np.asarray(logits, dtype=np.float64)
    top = logits.max(-1, keepdims=True)
    log_norm = top[:, 0] + np.log(np.exp(logits - top).sum(-1))
    return log_norm - logits[np.arange(len(logits)), np.asarray(targets)]
