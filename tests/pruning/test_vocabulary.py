"""Vocabulary trimming of text models: kept ids give the same logits, dropped ids read as the
unknown token, and the trimmed model saves, reloads and exports with the tokenizer's ids as input."""

import numpy as np
import pytest
import torch

from pruneops.core.errors import ConfigError
from pruneops.core.inputs import text_inputs
from pruneops.models.checkpoint import load_checkpoint, save_checkpoint
from pruneops.models.registry import ModelSpec
from pruneops.pruning.vocabulary import trim_vocabulary_, unknown_fraction, used_token_ids
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session

transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")

from pruneops.models.hf import SequenceLogits  # noqa: E402

VOCAB, UNK, PAD = 50, 3, 1
CONFIG = {
    "model_type": "roberta",
    "vocab_size": VOCAB,
    "hidden_size": 16,
    "num_hidden_layers": 1,
    "num_attention_heads": 2,
    "intermediate_size": 24,
    "max_position_embeddings": 40,
    "pad_token_id": PAD,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
KEPT = np.array([PAD, UNK, *range(10, 30)])  # id 0 goes; the padding row must stay row 1


def _model() -> SequenceLogits:
    from pruneops.models.hf import hf_classifier

    torch.manual_seed(0)
    return hf_classifier(3, CONFIG).eval()


def _batch(ids: list[list[int]]) -> dict[str, torch.Tensor]:
    x = torch.tensor(ids)
    return {"input_ids": x, "attention_mask": (x != PAD).long()}


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return model(batch["input_ids"], batch["attention_mask"])


def test_kept_ids_give_the_same_logits_and_dropped_ones_read_as_unknown():
    model = _model()
    seen = _batch([[10, 11, 12, 29, PAD], [20, 21, 22, 23, 24]])
    unseen = _batch([[10, 35, 12, 0, PAD], [49, 21, 22, 23, 24]])
    as_unknown = _batch([[10, UNK, 12, UNK, PAD], [UNK, 21, 22, 23, 24]])
    before_seen, before_unknown = _logits(model, seen), _logits(model, as_unknown)

    trim = trim_vocabulary_(model, KEPT, UNK)

    assert (trim.rows_before, trim.rows_after) == (VOCAB, len(KEPT))
    assert model.model.get_input_embeddings().weight.shape == (len(KEPT), 16)
    assert model.model.get_input_embeddings().padding_idx == PAD
    torch.testing.assert_close(_logits(model, seen), before_seen)
    torch.testing.assert_close(_logits(model, unseen), before_unknown)


def test_trimming_again_keeps_the_tokenizers_ids():
    model = _model()
    batch = _batch([[10, 11, 12, 29, PAD]])
    before = _logits(model, batch)
    trim_vocabulary_(model, KEPT, UNK)
    trim_vocabulary_(model, np.array([PAD, UNK, 10, 11, 12, 29]), UNK)
    assert model.model.get_input_embeddings().num_embeddings == 6
    torch.testing.assert_close(_logits(model, batch), before)


def test_a_trimmed_model_reloads_and_exports_with_identical_logits(tmp_path):
    model = _model()
    trim_vocabulary_(model, KEPT, UNK)
    batch = _batch([[10, 11, 40, 29, PAD], [20, 0, 22, 23, 24]])
    expected = _logits(model, batch)
    spec = ModelSpec(
        name="hf",
        input_shape=[5],
        num_classes=3,
        kwargs={"hf_config": CONFIG},
        inputs=[s.to_dict() for s in text_inputs()],
    )
    save_checkpoint(tmp_path / "model.safetensors", model, spec)
    reloaded = load_checkpoint(tmp_path / "model.safetensors").model
    torch.testing.assert_close(_logits(reloaded, batch), expected)

    export_onnx_file(model, text_inputs(), tmp_path / "m.onnx", opset=18, sizes={"seq": 5})
    got = make_session(tmp_path / "m.onnx").run(None, {k: v.numpy() for k, v in batch.items()})[0]
    np.testing.assert_allclose(got, expected.numpy(), atol=1e-5, rtol=1e-4)


def test_the_unknown_token_must_be_kept_and_a_model_without_embeddings_is_refused():
    with pytest.raises(ConfigError, match="unknown token"):
        trim_vocabulary_(_model(), np.array([PAD, 10, 11]), UNK)
    with pytest.raises(ConfigError, match="text models"):
        trim_vocabulary_(torch.nn.Linear(3, 2), KEPT, UNK)


def test_used_ids_and_the_unknown_fraction_count_only_real_tokens():
    ids = np.array([[5, 6, 7, PAD], [5, 8, UNK, PAD]])
    mask = np.array([[1, 1, 1, 0], [1, 1, 1, 0]])
    kept = used_token_ids(ids[:1], mask[:1], [UNK, PAD])
    assert kept.tolist() == [PAD, UNK, 5, 6, 7]
    # Second row: 8 was not kept and UNK already is unknown: 2 of its 3 real tokens, 2 of 6 overall.
    assert unknown_fraction(ids, mask, kept, UNK) == pytest.approx(2 / 6)


def test_the_prune_stage_step_reports_what_trimming_cost_on_unseen_text(tmp_path):
    from pruneops.core.io import Layout
    from pruneops.data import Split
    from pruneops.data.text import load_tokenizer, tokenize
    from pruneops.models.hf import hf_classifier
    from pruneops.pruning.vocabulary import trim_vocabulary
    from tests.text_helpers import SPECIALS, WORDS, build_tokenizer

    layout = Layout(tmp_path)
    layout.stage_dir("validate").mkdir(parents=True)
    tokenizer = load_tokenizer(build_tokenizer(layout.stage_dir("validate") / "tokenizer.json"))

    def split(texts: list[str]) -> Split:
        return Split(tokenize(tokenizer, texts, 8), np.arange(len(texts)) % 2)

    train = split(["good film", "bad movie", "good plot"] * 4)
    val = split(["good film", "bad fun"])  # "fun" is not in train: 1 of 8 real tokens
    test = split(["bad movie", "dull awful"])  # 2 of 8
    torch.manual_seed(0)
    config = {**CONFIG, "model_type": "bert", "vocab_size": len(SPECIALS) + len(WORDS), "pad_token_id": 0}
    model = hf_classifier(2, config).eval()

    out = trim_vocabulary(model, layout, train, val, test)

    # Kept: [PAD] (padding), [UNK], [CLS], [SEP] (in every text) and good, bad, film, movie, plot.
    assert (out["rows_before"], out["rows_after"]) == (len(SPECIALS) + len(WORDS), 9)
    assert out["params_removed"] == (len(WORDS) - 5) * 16
    assert out["unknown_fraction_val_before"] == 0.0 and out["unknown_fraction_val_after"] == pytest.approx(1 / 8)
    assert out["unknown_fraction_test_after"] == pytest.approx(2 / 8)
    assert 0.0 <= out["val_accuracy_after"] <= 1.0
