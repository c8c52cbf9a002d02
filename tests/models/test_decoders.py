"""Decoder cuts on tiny random models of six families (built in the test); every family: test_decoder_families."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.models.decoder_layout import layout_of  # noqa: E402
from pruneops.models.decoders import load_causal_lm, mlp_width, save_causal_lm  # noqa: E402
from pruneops.pruning import decoder_cuts as D  # noqa: E402
from tests.decoder_helpers import FAMILIES, HEAD_FAMILIES, random_blocks, tiny_decoder, tiny_tokenizer  # noqa: E402


def _logits(model, ids):
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_every_family_cuts_mlp_and_depth_and_reloads_from_its_config(family, tmp_path):
    model = tiny_decoder(family)
    blocks = random_blocks(8)
    calibration = D.calibrate(model, blocks)
    assert len(calibration.block_influence) == 4
    D.prune_mlp_(model, 24, calibration, "activation", reconstruct=True)
    dropped = D.drop_layers_(model, calibration, 1)
    assert len(dropped) == 1 and mlp_width(model) == 24
    assert len(layout_of(model).decoder_layers(model)) == 3
    # The config alone describes the pruned model: a fresh build loads its weights strictly.
    rebuilt = D.rebuild(model)
    torch.testing.assert_close(_logits(rebuilt, blocks[:2]), _logits(model, blocks[:2]))
    save_causal_lm(model, tiny_tokenizer(), tmp_path / "pruned")
    reloaded, _ = load_causal_lm(tmp_path / "pruned")
    torch.testing.assert_close(_logits(reloaded, blocks[:2]), _logits(model, blocks[:2]))


@pytest.mark.parametrize("family", HEAD_FAMILIES)
def test_head_cut_by_kv_group_keeps_generation_with_a_cache(family):
    model = tiny_decoder(family)
    config = model.config
    kv = config.num_key_value_heads
    per_group = config.num_attention_heads // kv
    calibration = D.calibrate(model, random_blocks(8))
    D.prune_heads_(model, max(1, kv - 1) if kv > 1 else 1, max(1, per_group - 1), calibration)
    assert config.num_attention_heads == config.num_key_value_heads * max(1, per_group - 1)
    rebuilt = D.rebuild(model)
    ids = random_blocks(1, 6, seed=3)
    # Greedy generation with the KV cache agrees with recomputing the whole prefix each step.
    out = rebuilt.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=5, do_sample=False, pad_token_id=2)
    prefix = ids
    for _ in range(5):
        nxt = _logits(rebuilt, prefix)[:, -1].argmax(-1, keepdim=True)
        prefix = torch.cat([prefix, nxt], 1)
    assert torch.equal(out, prefix)


def test_depth_cut_generates_with_a_cache_after_reindexing():
    model = tiny_decoder("llama")
    D.drop_layers_(model, D.calibrate(model, random_blocks(8)), 2)
    ids = random_blocks(1, 6, seed=4)
    mask = torch.ones_like(ids)
    cached = model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=2)
    uncached = model.generate(
        ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=2, use_cache=False
    )
    assert torch.equal(cached, uncached)


@pytest.mark.parametrize("family", ["gpt2", "gpt_neox"])
def test_fused_attention_layouts_refuse_a_head_cut_with_the_reason(family):
    model = tiny_decoder(family)
    with pytest.raises(ConfigError, match="cannot be cut"):
        D.prune_heads_(model, 1, 1, None)


def test_reconstruction_with_every_input_kept_changes_nothing():
    model = tiny_decoder("qwen2")
    calibration = D.calibrate(model, random_blocks(16))
    _, down = layout_of(model).mlp_modules(layout_of(model).decoder_layers(model)[0])
    before = down.weight.detach().clone()
    D.least_squares_(down, calibration.mlp[0], torch.arange(before.shape[1]))
    # Only the ridge moves the solution: relative change of the order of the ridge.
    assert (down.weight - before).norm() / before.norm() < 20 * D.RIDGE


@pytest.mark.parametrize("family", ["llama", "gpt2"])
def test_reconstruction_reproduces_the_dense_layer_output_better_than_slicing(family):
    """On the calibration inputs the re-solved projection is closer to the dense output than the slice."""
    model = tiny_decoder(family)
    blocks = random_blocks(16)
    calibration = D.calibrate(model, blocks)
    stats = calibration.mlp[1]
    layout = layout_of(model)
    down = layout.mlp_modules(layout.decoder_layers(model)[1])[1]
    width = D.weight_out_in(down).shape[1]
    keep = torch.arange(0, width, 2)
    dense_w = D.weight_out_in(down).double()
    sliced = torch.zeros_like(dense_w)
    sliced[:, keep] = dense_w[:, keep]
    solved = copy.deepcopy(down)
    D.least_squares_(solved, stats, keep)
    new_w = D.weight_out_in(solved).double()
    bias_shift = (solved.bias - down.bias).detach().double() if getattr(down, "bias", None) is not None else 0.0
    n, gram, total = stats.count, stats.gram, stats.total

    def error(w, shift):  # mean ||X (w - W)^T + shift||^2 from the Gram matrix
        d = w - dense_w
        quad = torch.einsum("oi,ij,oj->", d, gram, d)
        lin = 2 * (d @ total * shift).sum() if torch.is_tensor(shift) else 0.0
        const = n * (shift**2).sum() if torch.is_tensor(shift) else 0.0
        return float((quad + lin + const) / n)

    e_slice, e_solved = error(sliced, 0.0), error(new_w, bias_shift)
    # The exact least-squares optimum on the kept inputs (no ridge), solved here independently.
    g_kk, g_k = gram[keep][:, keep], gram[keep]
    optimum = torch.zeros_like(dense_w)
    optimum[:, keep] = torch.linalg.solve(g_kk, g_k @ dense_w.T).T
    e_opt = error(optimum, 0.0)
    assert e_solved < e_slice
    # Within the ridge's pull of the optimum (a bias, where the layer has one, can only lower it).
    assert e_solved <= e_opt * (1 + 50 * D.RIDGE), (e_solved, e_opt, e_slice)


def test_activation_importance_keeps_neurons_that_carry_signal():
    """A neuron whose input is large on calibration text outranks one that is always near zero."""
    stats = D.ProjectionInputs(torch.zeros(3, 3, dtype=torch.float64), torch.zeros(3, dtype=torch.float64))
    stats.add(torch.tensor([[10.0, 0.01, 1.0]] * 4))
    output = torch.ones(2, 3)
    scores = D.NEURON_IMPORTANCES.get("activation")([], output, stats)
    assert scores.argsort().tolist() == [1, 2, 0]
    assert torch.allclose(D.NEURON_IMPORTANCES.get("magnitude")([], output, stats), torch.full((3,), 2**0.5))


def test_block_influence_ranks_an_identity_layer_least():
    """A layer whose output equals its input (its residual branches zeroed) has influence ~0 and goes first."""
    model = tiny_decoder("llama")
    layer = layout_of(model).decoder_layers(model)[2]
    with torch.no_grad():
        layer.mlp.down_proj.weight.zero_()
        layer.self_attn.o_proj.weight.zero_()
    calibration = D.calibrate(model, random_blocks(8))
    assert calibration.block_influence[2] < 1e-6 < min(calibration.block_influence[i] for i in (0, 1, 3))
    assert D.least_influential_layers(calibration, 1) == [2]


def test_out_of_range_widths_are_refused():
    model = tiny_decoder("llama")
    with pytest.raises(ConfigError, match="outside"):
        D.prune_mlp_(model, 49, None, "magnitude", reconstruct=False)
    with pytest.raises(ConfigError, match="calibration"):
        D.prune_mlp_(model, 8, None, "activation")
    with pytest.raises(ConfigError, match="no model"):
        D.drop_layers_(model, D.calibrate(model, random_blocks(2)), 4)
