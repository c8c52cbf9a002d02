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


def _zero_shot_config(tmp_path, rows: list[dict], **keys) -> ValidateConfig:
    import json

    (tmp_path / "check.jsonl").write_text("\n".join(json.dumps(r) for r in rows))
    (tmp_path / "corpus.txt").write_text("unused")
    files = {"path": str(tmp_path / "corpus.txt"), "zero_shot": str(tmp_path / "check.jsonl"), "tokenizer": "unused"}
    return ValidateConfig(dataset="corpus", zero_shot_prompt="{text} it was", **files, **keys)


REVIEWS = [{"text": f"the {w} film", "label": label} for w, label in [("great", "good"), ("awful", "bad")] * 5]


@pytest.mark.parametrize("bos", [False, True])
def test_the_zero_shot_check_is_tokenised_as_the_model_reads_it_in_two_halves(bos, tmp_path):
    from pruneops.data.zero_shot import ZERO_SHOT_SPLITS
    from pruneops.task.causal_lm.validate import _zero_shot_items

    tokenizer = tiny_tokenizer(bos=bos)
    check = _zero_shot_items(_zero_shot_config(tmp_path, REVIEWS), tokenizer)
    assert check["labels"] == ["bad", "good"]  # the file's labels, sorted
    assert [len(check[name]) for name in ZERO_SHOT_SPLITS] == [5, 5]
    first = check["zero_shot_val"][0]
    ids = tokenizer("the great film it was", add_special_tokens=False)["input_ids"]
    assert first["context"] == ([tokenizer.bos_token_id] if bos else []) + ids and first["answer"] == 1
    assert check["targets"] == [tokenizer(" bad", add_special_tokens=False)["input_ids"],
                                tokenizer(" good", add_special_tokens=False)["input_ids"]]  # fmt: skip


def test_a_zero_shot_label_outside_the_labels_given_is_one_line(tmp_path):
    from pruneops.task.causal_lm.validate import _zero_shot_items

    config = _zero_shot_config(tmp_path, REVIEWS, zero_shot_labels=["good", "neutral"])
    with pytest.raises(DataError, match=r"validate.zero_shot: .*label 'bad' is not among \['good', 'neutral'\]"):
        _zero_shot_items(config, tiny_tokenizer())


def test_a_zero_shot_prompt_without_the_text_is_refused():
    with pytest.raises(ValueError, match=r"\{text\}"):
        ValidateConfig(dataset="corpus", path="c.txt", tokenizer="t", zero_shot_prompt="Answer:")


def test_a_zero_shot_file_sorted_by_label_gives_every_label_when_it_holds_more_items_than_asked(tmp_path):
    from collections import Counter

    from pruneops.task.causal_lm.validate import _zero_shot_items

    rows = [{"text": f"the great film {i}", "label": "good"} for i in range(60)]
    rows += [{"text": f"the awful film {i}", "label": "bad"} for i in range(60)]  # a file sorted by label
    check = _zero_shot_items(_zero_shot_config(tmp_path, rows, zero_shot_items=40), tiny_tokenizer())
    answers = Counter(item["answer"] for half in ("zero_shot_val", "zero_shot") for item in check[half])
    assert sum(answers.values()) == 40
    # 40 of 120 drawn without replacement: each label's count is hypergeometric (mean 20, sd 2.6); 8 is 4.6 sd out.
    assert min(answers.values()) >= 8
    again = _zero_shot_items(_zero_shot_config(tmp_path, rows, zero_shot_items=40), tiny_tokenizer())
    assert again == check  # seeded: the same items every run
