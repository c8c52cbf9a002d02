"""Corpora split by document into token blocks, their checks, perplexity and the zero-shot check."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import DataError, DataValidationError  # noqa: E402
from pruneops.data.corpus import CorpusChecks, build_corpus, read_documents, split_documents  # noqa: E402
from pruneops.models.language import (  # noqa: E402
    paired_ratio_interval,
    perplexity,
    perplexity_from_losses,
    wilson,
    zero_shot_accuracy,
)
from tests.decoder_helpers import VOCAB, speeches, tiny_tokenizer  # noqa: E402


def test_documents_split_whole_seeded_and_disjoint():
    docs = speeches(40)
    a, b = split_documents(docs, 0.1, 0.2, seed=3), split_documents(docs, 0.1, 0.2, seed=3)
    assert a == b and len(a["test"]) == 8 and len(a["val"]) == 4 and len(a["train"]) == 28
    assert sorted(a["train"] + a["val"] + a["test"]) == sorted(docs)
    assert split_documents(docs, 0.1, 0.2, seed=4) != a


def test_blocks_hold_every_token_of_their_split_joined_by_eos():
    tok = tiny_tokenizer()
    splits = build_corpus(speeches(40), tok, block_length=16, seed=0)
    for name in ("train", "val", "test"):
        blocks = getattr(splits, name)
        assert blocks.shape[1] == 16 and blocks.dtype == np.int64
        assert len(blocks) == splits.tokens[name] // 16
        # one end-of-sequence token per document, tail dropped: at most one document's worth lost
        assert (blocks == tok.eos_token_id).sum() >= splits.documents[name] - 16


@pytest.mark.parametrize(
    ("docs", "message"),
    [
        ([*speeches(20), speeches(20)[3].upper()], "duplicate documents"),
        ([*speeches(20), ""], "shorter than"),
        ([], "no documents"),
    ],
)
def test_a_bad_corpus_fails_its_checks_in_one_line(docs, message):
    with pytest.raises(DataValidationError, match=message):
        build_corpus(docs, tiny_tokenizer(), 16)


def test_unknown_tokens_above_the_allowed_rate_fail():
    docs = [d + " zebra quokka" for d in speeches(30)]
    with pytest.raises(DataValidationError, match="unknown-token rate"):
        build_corpus(docs, tiny_tokenizer(), 16, checks=CorpusChecks(max_unknown_token_rate=0.01))
    build_corpus(docs, tiny_tokenizer(), 16, checks=CorpusChecks(max_unknown_token_rate=0.1))


def test_a_split_too_small_for_one_block_is_refused():
    with pytest.raises(DataValidationError, match="holds no block"):
        build_corpus(speeches(12), tiny_tokenizer(), 512)


def test_corpus_formats_read_the_same_documents(tmp_path):
    docs = speeches(6)
    (tmp_path / "c.txt").write_text("\n\n".join(docs))
    (tmp_path / "c.jsonl").write_text("\n".join(json.dumps({"body": d}) for d in docs))
    import pandas as pd

    pd.DataFrame({"body": docs}).to_parquet(tmp_path / "c.parquet")
    assert read_documents(tmp_path / "c.txt") == docs
    assert read_documents(tmp_path / "c.jsonl", "body") == docs
    assert read_documents(tmp_path / "c.parquet", "body") == docs
    with pytest.raises(DataError, match="no column 'text'"):
        read_documents(tmp_path / "c.jsonl")
    with pytest.raises(DataError, match="does not exist"):
        read_documents(tmp_path / "missing.txt")


class _Uniform(torch.nn.Module):
    """Equal logits for every token: perplexity is exactly the vocabulary size."""

    def forward(self, input_ids, use_cache=False):
        class Out:
            logits = torch.zeros(*input_ids.shape, VOCAB)

        return Out()


def test_perplexity_of_uniform_logits_is_the_vocabulary_size():
    blocks = torch.randint(0, VOCAB, (10, 12))
    result = perplexity(_Uniform(), blocks)
    assert result.value == pytest.approx(VOCAB, rel=1e-6)
    assert result.low == pytest.approx(VOCAB, rel=1e-6) and result.high == pytest.approx(VOCAB, rel=1e-6)
    assert result.tokens == 10 * 11


def test_bootstrap_interval_is_over_blocks_and_the_paired_ratio_cancels_shared_difficulty():
    rng = np.random.default_rng(0)
    difficulty = rng.normal(3.0, 0.5, 200)  # blocks differ a lot in difficulty
    reference = perplexity_from_losses(difficulty, 200 * 255)
    candidate = perplexity_from_losses(difficulty + 0.05 + rng.normal(0, 0.01, 200), 200 * 255)
    assert reference.low < reference.value < reference.high
    ratio, low, high = paired_ratio_interval(candidate, reference)
    assert ratio == pytest.approx(math.exp(0.05), abs=0.005)
    # pairing: the ratio's interval is far narrower than either perplexity's own
    assert (high - low) < 0.2 * (reference.high - reference.low) / reference.value
    assert low > 1.0


class _Prefers(torch.nn.Module):
    """Logits that favour one token everywhere: every example is answered with that label."""

    def __init__(self, token: int):
        super().__init__()
        self.token = token

    def forward(self, input_ids, use_cache=False):
        logits = torch.zeros(*input_ids.shape, VOCAB)
        logits[..., self.token] = 5.0
        return type("Out", (), {"logits": logits})()


def test_zero_shot_check_scores_labels_by_likelihood():
    tok = tiny_tokenizer()
    good = tok.convert_tokens_to_ids("good")
    examples = [("a great film", "good")] * 4 + [("an awful film", "bad")] * 2
    accuracy, low, high = zero_shot_accuracy(_Prefers(good), tok, examples, "review : {text} . it was", ["good", "bad"])
    assert accuracy == pytest.approx(4 / 6)
    assert (low, high) == pytest.approx(wilson(4, 6)[1:])
    accuracy, *_ = zero_shot_accuracy(
        _Prefers(tok.convert_tokens_to_ids("bad")), tok, examples, "{text}", ["good", "bad"]
    )
    assert accuracy == pytest.approx(2 / 6)


def test_wilson_interval_matches_its_formula():
    p, low, high = wilson(80, 100)
    assert p == 0.8 and low == pytest.approx(0.7112, abs=1e-3) and high == pytest.approx(0.8666, abs=1e-3)
    assert all(math.isnan(x) for x in wilson(0, 0))
