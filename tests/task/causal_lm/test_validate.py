"""The decoder validate stage: general text halved, one half to gate on and the other to report."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from pruneops.config import ValidateConfig  # noqa: E402
from pruneops.core.errors import DataError  # noqa: E402
from pruneops.task.causal_lm.validate import GENERAL_SPLITS, _general_halves  # noqa: E402
from tests.decoder_helpers import speeches, tiny_tokenizer  # noqa: E402


def _config(tmp_path, text: str, blocks: int = 32) -> ValidateConfig:
    (tmp_path / "general.txt").write_text(text)
    (tmp_path / "corpus.txt").write_text("unused")
    files = {"path": str(tmp_path / "corpus.txt"), "general_text": str(tmp_path / "general.txt"), "tokenizer": "unused"}
    return ValidateConfig(dataset="corpus", general_blocks=blocks, block_length=16, **files)


@pytest.mark.parametrize("documents", [40, 1])  # many documents alternate; one long text's blocks do
def test_general_text_is_halved_into_disjoint_capped_splits(documents, tmp_path):
    texts = speeches(40, seed=3)
    text = "\n\n".join(texts) if documents > 1 else " ".join(texts)
    halves = _general_halves(_config(tmp_path, text, blocks=6), tiny_tokenizer())
    assert tuple(halves) == GENERAL_SPLITS and all(h.shape == (6, 16) for h in halves.values())
    gated, reported = ({tuple(row) for row in halves[name]} for name in GENERAL_SPLITS)
    assert not gated & reported


def test_general_text_too_short_to_halve_is_one_line(tmp_path):
    with pytest.raises(DataError, match="fewer than 2 blocks of 16 tokens for general"):
        _general_halves(_config(tmp_path, "the people work"), tiny_tokenizer())


def test_general_blocks_are_what_the_tokenizer_makes_of_each_half(tmp_path):
    from pruneops.data.corpus import read_documents, to_blocks

    config = _config(tmp_path, "\n\n".join(speeches(10, seed=4)))
    documents = read_documents(config.general_text, config.text_column, config.encoding)
    halves = _general_halves(config, tiny_tokenizer())
    np.testing.assert_array_equal(halves["general"], to_blocks(documents[1::2], tiny_tokenizer(), 16)[0])
