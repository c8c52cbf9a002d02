"""A zero-shot check of a causal LM (`validate.zero_shot`), as `validate` writes it, and how a model answers it.

`validate` tokenises each item as the model reads it and halves the items: `zero_shot_val` is what
`quantize` holds to `prune.gate.max_zero_shot_drop`, `zero_shot` what the benchmark and the
re-prune gate report and judge.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pruneops.core.io import read_json
from pruneops.core.logits import token_nll

ZERO_SHOT_FILE = "zero_shot.json"  # validate's zero-shot check, tokenised
ZERO_SHOT_SPLITS = ("zero_shot_val", "zero_shot")  # the budget's half, the benchmark's half


def read_zero_shot(folder: Path) -> dict | None:
    """The zero-shot check in `validate`'s output folder (None: `validate.zero_shot` not set)."""
    path = Path(folder) / ZERO_SHOT_FILE
    return read_json(path) if path.is_file() else None


def zero_shot_correct(opened: object, check: dict, split: str) -> np.ndarray:
    """Whether an opened model (any runtime's) answers each item of `split` right: the likeliest label by its logits.

    A label's score is the summed next-token loss of its tokens after the item's context, in the
    model's own exported logits, as lm-eval's multiple-choice log-likelihood is.
    """
    right = [
        int(np.argmin(answer_losses(opened, item["context"], check["targets"]))) == item["answer"]
        for item in check[split]
    ]
    return np.asarray(right)


def answer_losses(opened: object, context: list[int], answers: list[list[int]]) -> list[float]:
    """The summed next-token loss of each answer's tokens after `context`, in the model's logits (`logits(ids)`).

    One prefill of the context and an answer serves every answer that shares the tokens it needs:
    answer t needs the rows after `context + t[:i]` for each i < len(t), so answers of one token
    (the usual labels) all read the row after the context, and the context is evaluated once, not
    once per answer. The losses are those of scoring each answer on its own (causal attention: a
    row sees only the tokens before it).
    """
    runs: list[tuple[list[int], np.ndarray]] = []  # an answer prefilled, and its rows from the context's last on
    out = []
    for answer in answers:
        shared = len(answer) - 1  # the answer's tokens its rows see
        rows = next((rows for done, rows in runs if done[:shared] == answer[:shared]), None)
        if rows is None:
            rows = opened.logits(np.asarray(context + answer))[len(context) - 1 :]
            runs.append((answer, rows))
        out.append(float(token_nll(rows[: len(answer)], np.asarray(answer)).sum()))
    return out
