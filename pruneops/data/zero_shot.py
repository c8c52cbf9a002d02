"""A zero-shot check of a causal LM (`validate.zero_shot`), as `validate` writes it, and how a model answers it.

`validate` tokenises each item as the model reads it and halves the items: `zero_shot_val` is what
`quantize` holds to `prune.gate.max_zero_shot_drop`, `zero_shot` what the benchmark and the
re-prune gate report and judge.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pruneops.core.io import read_json

ZERO_SHOT_FILE = "zero_shot.json"  # validate's zero-shot check, tokenised
ZERO_SHOT_SPLITS = ("zero_shot_val", "zero_shot")  # the budget's half, the benchmark's half


def read_zero_shot(folder: Path) -> dict | None:
    """The zero-shot check in `validate`'s output folder (None: `validate.zero_shot` not set)."""
    path = Path(folder) / ZERO_SHOT_FILE
    return read_json(path) if path.is_file() else None


def zero_shot_correct(opened: object, check: dict, split: str) -> np.ndarray:
    """Whether an opened model (any runtime's) answers each item of `split` right: the likeliest label by its logits.

    A label's score is the summed next-token loss of its tokens after the item's context, in the
    model's own exported logits (`token_losses`), as lm-eval's multiple-choice log-likelihood is.
    """
    right = []
    for item in check[split]:
        context = item["context"]
        nll = [float(opened.token_losses(np.asarray(context + t))[len(context) - 1 :].sum()) for t in check["targets"]]
        right.append(int(np.argmin(nll)) == item["answer"])
    return np.asarray(right)
