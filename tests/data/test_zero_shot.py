"""The zero-shot check's answers scored from one prefill per item where the answers allow it."""

from __future__ import annotations

import numpy as np
import pytest

from pruneops.core.logits import token_nll
from pruneops.data.zero_shot import answer_losses, zero_shot_correct

VOCAB = 32


class _Causal:
    """Logits of row i from the tokens up to i only (as a causal LM's), counting prefills and tokens."""

    def __init__(self) -> None:
        self.prefills, self.tokens = 0, 0
        self.table = np.random.default_rng(0).normal(size=(VOCAB, VOCAB))

    def logits(self, ids: np.ndarray) -> np.ndarray:
        self.prefills += 1
        self.tokens += len(ids)
        running = np.cumsum(self.table[np.asarray(ids)], axis=0)  # row i: every token up to i
        return np.sin(running * np.arange(1, len(ids) + 1)[:, None])

    def on_its_own(self, context: list[int], answer: list[int]) -> float:
        """The answer scored by prefilling context + answer alone (the rule every runtime's scoring follows)."""
        ids = np.asarray(context + answer)
        return float(token_nll(self.logits(ids)[:-1], ids[1:])[len(context) - 1 :].sum())


@pytest.mark.parametrize(
    ("answers", "prefills"),
    [
        ([[5], [6]], 1),  # one-token labels: the row after the context serves both
        ([[5], [6], [7], [8]], 1),
        ([[5, 9], [5, 3]], 1),  # a shared first token: the second rows differ only in what they predict
        ([[5, 9], [6, 3]], 2),  # the second token follows a different first: its own prefill
        ([[5], [6, 3, 1]], 2),
        ([[6, 3, 1], [5], [6, 3, 2]], 1),  # the first prefill serves the rest: they need only its rows
    ],
)
def test_each_answer_scores_as_on_its_own_from_as_few_prefills_as_its_tokens_allow(answers, prefills):
    model, context = _Causal(), [1, 2, 3, 4]
    expected = [model.on_its_own(context, answer) for answer in answers]
    model.prefills = 0
    assert answer_losses(model, context, answers) == pytest.approx(expected, rel=1e-12)
    assert model.prefills == prefills


def test_one_token_labels_evaluate_each_context_once_and_choose_as_before():
    model = _Causal()
    items = [
        {"context": [int(t) for t in np.random.default_rng(i).integers(0, VOCAB, 6)], "answer": i % 2}
        for i in range(20)
    ]
    check = {"targets": [[5], [6]], "zero_shot_val": items}
    per_answer = [
        int(np.argmin([model.on_its_own(item["context"], t) for t in check["targets"]])) == item["answer"]
        for item in items
    ]
    model.prefills = model.tokens = 0
    assert zero_shot_correct(model, check, "zero_shot_val").tolist() == per_answer
    assert model.prefills == 20 and model.tokens == 20 * 7  # before: 40 prefills of 7 tokens
