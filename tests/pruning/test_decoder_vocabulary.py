"""A decoder's output vocabulary cut to K rows and a tail row: a distribution over every token, exported alike."""

from __future__ import annotations

import copy
import math

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import PruneOpsError  # noqa: E402
from pruneops.models.language import block_losses  # noqa: E402
from pruneops.pruning.decoder_vocabulary import (  # noqa: E402
    OutputHead,
    choose_vocabulary,
    cut_vocabulary_,
    vocabulary_evidence,
)
from tests.decoder_helpers import VOCAB, random_blocks, tiny_decoder, tiny_tokenizer  # noqa: E402

FAMILIES = ("llama", "qwen2", "gpt_neox")


@pytest.mark.parametrize("family", FAMILIES)
def test_every_token_keeps_a_probability_and_kept_logits_stay_exact(family):
    dense = tiny_decoder(family, seed=1)
    calibration = random_blocks(6, 24, seed=2)
    cut = choose_vocabulary(dense, vocabulary_evidence(dense, calibration), keep=12, tail_groups=4)
    model = copy.deepcopy(dense)
    cut_vocabulary_(model, cut)
    blocks = random_blocks(2, 16, seed=3)
    with torch.inference_mode():
        full = dense(blocks).logits
        trimmed = model(blocks).logits
    assert trimmed.shape == full.shape and isinstance(model.lm_head, OutputHead)
    assert len(cut.kept) == 12 and model.lm_head.weight.shape[0] == 12 + 4
    probabilities = torch.softmax(trimmed, -1)
    assert torch.all(probabilities > 0)
    torch.testing.assert_close(probabilities.sum(-1), torch.ones(probabilities.shape[:-1]))
    # Kept tokens' logits are the dense ones, up to the shared normalisation (a softmax shift).
    shift = (trimmed[..., cut.kept] - full[..., cut.kept]).mean(-1, keepdim=True)
    torch.testing.assert_close(trimmed[..., cut.kept], full[..., cut.kept] + shift, atol=1e-4, rtol=1e-4)
    # The input embedding is untouched (untied from the head).
    assert model.get_input_embeddings().weight.shape[0] == VOCAB


def test_kept_tokens_are_the_ones_the_calibration_text_uses():
    dense = tiny_decoder("llama", seed=4)
    calibration = torch.full((4, 24), 7)
    calibration[:, ::2] = 9
    cut = choose_vocabulary(dense, vocabulary_evidence(dense, calibration), keep=5)
    assert {7, 9} <= set(cut.kept.tolist())


@pytest.mark.parametrize(("keep", "groups"), [(VOCAB - 1, 1), (8, VOCAB)])
def test_a_tail_of_one_token_is_fitted_exactly_and_scores_as_dense(keep, groups):
    dense = tiny_decoder("llama", seed=5)
    calibration = random_blocks(8, 24, seed=6)
    # A group of one token: its logsumexp is its own logit, linear in the hidden state.
    cut = choose_vocabulary(dense, vocabulary_evidence(dense, calibration), keep, tail_groups=groups)
    assert cut.fit_rms < 1e-3 and len(cut.tail_bias) == VOCAB - keep
    model = copy.deepcopy(dense)
    cut_vocabulary_(model, cut)
    np.testing.assert_allclose(block_losses(model, calibration), block_losses(dense, calibration), atol=1e-3)


@pytest.mark.parametrize("groups", [1, 4])
def test_groups_of_many_tokens_are_fitted_approximately_and_every_loss_stays_finite(groups):
    dense = tiny_decoder("llama", seed=5)
    calibration = random_blocks(8, 24, seed=6)
    cut = choose_vocabulary(dense, vocabulary_evidence(dense, calibration), 8, tail_groups=groups)
    assert len(cut.tail_bias) == groups and sorted(set(cut.group.tolist())) == [-1, *range(groups)]
    assert 1e-3 < cut.fit_rms < 10
    narrow = copy.deepcopy(dense)
    cut_vocabulary_(narrow, cut)
    assert all(math.isfinite(x) for x in block_losses(narrow, random_blocks(4, 24, seed=7)))


def test_evidence_is_the_models_expected_counts_on_the_fitted_blocks_and_the_texts_counts():
    dense = tiny_decoder("llama", seed=4)
    blocks = random_blocks(5, 24, seed=2)
    evidence = vocabulary_evidence(dense, blocks, fit_blocks=3, batch_size=2)
    with torch.inference_mode():
        logits = dense(blocks[:3]).logits[:, :-1].double()
    assert evidence.hidden.shape == (3 * 23, dense.config.hidden_size)
    # Summed in float32 per batch: the tolerance is float32's over a few dozen positions.
    torch.testing.assert_close(evidence.expected, torch.softmax(logits, -1).sum((0, 1)), rtol=1e-5, atol=1e-5)
    assert evidence.counts.sum() == 5 * 23 and evidence.counts[blocks[0, 1]] >= 1


def test_a_head_already_cut_or_evidence_of_another_vocabulary_is_refused():
    dense = tiny_decoder("llama", seed=4)
    calibration = random_blocks(4, 24, seed=2)
    evidence = vocabulary_evidence(dense, calibration)
    model = copy.deepcopy(dense)
    cut_vocabulary_(model, choose_vocabulary(dense, evidence, keep=8))
    with pytest.raises(PruneOpsError, match="bias-free Linear"):
        vocabulary_evidence(model, calibration)
    other = tiny_decoder("llama", seed=4, vocab_size=VOCAB + 8)
    with pytest.raises(PruneOpsError, match="evidence covers"):
        choose_vocabulary(other, evidence, keep=8)


def test_keep_outside_the_vocabulary_is_refused():
    dense = tiny_decoder("llama")
    with pytest.raises(PruneOpsError, match="keep"):
        choose_vocabulary(dense, vocabulary_evidence(dense, random_blocks(2)), keep=VOCAB)


@pytest.mark.parametrize("precision", ["fp32", "int8", "int4"])
def test_the_export_scores_as_torch_does(tmp_path, precision):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from pruneops.runtimes.genai.export import export_model as export_genai
    from pruneops.runtimes.genai.generation import exported_block_losses, greedy_tokens

    dense = tiny_decoder("llama", seed=7, hidden_size=64, head_dim=16)
    calibration = random_blocks(6, 24, seed=8)
    model = copy.deepcopy(dense)
    cut_vocabulary_(model, choose_vocabulary(dense, vocabulary_evidence(dense, calibration), keep=16))
    folder = export_genai(model, tiny_tokenizer(), tmp_path, [precision], threads=1)[precision]
    assert isinstance(model.get_output_embeddings(), OutputHead)  # the export leaves the model as it was
    blocks = random_blocks(3, 20, seed=9)
    expected = block_losses(model, blocks)
    exported = exported_block_losses(folder, blocks.numpy())
    # fp32: the same arithmetic; int8/int4: weight rounding of a random model moves each block a little.
    tolerance = {"fp32": 1e-4, "int8": 0.05, "int4": 0.2}[precision]
    np.testing.assert_allclose(exported, expected, rtol=tolerance)
    tokens = greedy_tokens(folder, blocks[:1, :8].numpy(), 6)
    assert tokens.shape == (1, 6) and (tokens >= 0).all() and (tokens < VOCAB).all()


def _recovered_layout(root):
    """A layout holding what `quantize` reads: a recovered model, dense, and the corpus blocks.

    The recovered model is dense with its final norm scaled by 1.001: all but the same model, in
    files of its own (where the files are dense's own, quantize exports and scores them once).
    """
    from pruneops.core.io import Layout

    layout = Layout(root)
    model = tiny_decoder("llama", seed=11, hidden_size=64, head_dim=16)
    recovered = copy.deepcopy(model)
    with torch.no_grad():
        recovered.model.norm.weight.mul_(1.001)
    for stage, saved in (("train", model), ("finetune", recovered)):
        saved.save_pretrained(layout.stage_dir(stage) / "model")
        tiny_tokenizer().save_pretrained(layout.stage_dir(stage) / "model")
    (layout.stage_dir("train") / "runtimes.json").write_text('{"asked": "genai", "servable": ["genai"], "refused": {}}')
    layout.stage_dir("validate").mkdir(parents=True, exist_ok=True)
    # Text the model itself generates: scored on it, any approximation of its logits costs perplexity.
    torch.manual_seed(12)
    start = torch.full((32, 1), 3)
    sampled = model.generate(
        start,
        attention_mask=torch.ones_like(start),
        do_sample=True,
        max_new_tokens=31,
        min_new_tokens=31,
        pad_token_id=2,
    ).numpy()
    blocks = {"train": sampled[:8], "val": sampled[8:28], "test": sampled[28:]}
    np.savez(layout.stage_dir("validate") / "corpus.npz", **blocks)
    return layout


@pytest.mark.parametrize(("tolerance", "ships"), [(10.0, "fp32 vocab8"), (0.0, "fp32")])
def test_quantize_ships_a_vocabulary_cut_only_within_the_perplexity_tolerance(tmp_path, monkeypatch, tolerance, ships):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    import json

    from pruneops.config import BenchmarkConfig, QuantizeConfig
    from pruneops.runtimes.genai.generation import GenerationTiming, exported_block_losses
    from pruneops.task.causal_lm import quantize as quantize_stage

    layout = _recovered_layout(tmp_path)
    tpot = {"fp32": 4.0, "fp32 vocab8": 3.0}  # injected: the cut is faster

    def timed(folders, vocab, batch, benchmark, seed=0):
        ms = {n: tpot.get(n, 5.0) for n in folders}  # dense, timed beside the candidates: slower
        return {n: GenerationTiming(9.0, ms[n], (ms[n],), benchmark.prompt_length, 8, batch) for n in folders}

    monkeypatch.setattr(quantize_stage, "_timed", timed)
    config = QuantizeConfig(
        decoder_precisions=[], decoder_vocabulary=[8], decoder_tail_groups=1, perplexity_tolerance=tolerance
    )
    report = quantize_stage.quantize_decoder(config, BenchmarkConfig(), "decode", layout)
    choice = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    assert set(choice["candidates"]) == set(tpot)
    fp32 = choice["candidates"]["fp32"]["val_perplexity"]
    # The cut of a random model's vocabulary costs perplexity: it ships only when the tolerance allows.
    assert fp32 < choice["candidates"]["fp32 vocab8"]["val_perplexity"] < fp32 * 11
    expected = ships
    assert quantize_stage._candidate_name(report.precision, report.vocabulary) == expected
    assert (choice["precision"], choice["vocabulary"]) == (report.precision, report.vocabulary)
    served = layout.stage_dir("quantize") / "model"
    losses = exported_block_losses(served, np.load(layout.stage_dir("validate") / "corpus.npz")["val"])
    assert np.exp(losses.mean()) == pytest.approx(choice["candidates"][expected]["val_perplexity"], rel=1e-5)
