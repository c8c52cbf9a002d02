"""Any decoder family transformers builds: its layout read from the model, cut, reloaded and exported.

Tiny random models of each family (built in the test): the layout is derived, not looked up; a cut
(heads by KV group where the config expresses them, MLP neurons, one layer) leaves a model its own
config rebuilds strictly and `from_pretrained` reloads with the same logits; a no-op cut through the
same slicing code changes no greedy token; and the onnxruntime-genai export of the cut model gives
the torch model's greedy tokens.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.models.decoder_layout import layout_of  # noqa: E402
from pruneops.models.decoders import load_causal_lm, mlp_width, save_causal_lm  # noqa: E402
from pruneops.models.language import block_losses  # noqa: E402
from pruneops.pruning import decoder_cuts as D  # noqa: E402
from tests.decoder_helpers import (  # noqa: E402
    SERVED_FAMILIES,
    TORCH_ONLY_FAMILIES,
    family_decoder,
    random_blocks,
    tiny_tokenizer,
)

PROMPT = torch.tensor([[5, 6, 7, 8, 9, 10]])
NEW_TOKENS = 8
EOS = 1  # the tiny models' end-of-sequence id: greedy timing runs never choose it


def _logits(model: torch.nn.Module, ids: torch.Tensor) -> torch.Tensor:
    with torch.inference_mode():
        return model(input_ids=ids, use_cache=False).logits


def _greedy(model: torch.nn.Module, prompt: torch.Tensor = PROMPT, new: int = NEW_TOKENS) -> torch.Tensor:
    """Greedy continuation recomputed in full at every step, end-of-sequence excluded."""
    ids = prompt
    for _ in range(new):
        logits = _logits(model, ids)[:, -1]
        logits = logits.index_fill(1, torch.tensor([EOS]), -torch.inf)
        ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids[:, prompt.shape[1] :]


def _cut(model: torch.nn.Module) -> torch.nn.Module:
    """Fewer heads (where the config expresses them), half the MLP, one layer less."""
    layout = layout_of(model)
    heads = layout.attention is not None and layout.head_dim_key is not None
    calibration = D.calibrate(model, random_blocks(4, 16))
    kv = model.config.num_key_value_heads if layout.kv_heads_key else model.config.num_attention_heads
    per_group = model.config.num_attention_heads // kv
    layers = len(layout.decoder_layers(model))
    D.prune_to_shape_(model, layers - 1, mlp_width(model) // 2, kv - 1 if heads else kv, per_group, calibration)
    return model


@pytest.mark.parametrize("family", SERVED_FAMILIES + TORCH_ONLY_FAMILIES)
def test_every_family_is_cut_and_reloaded_from_its_own_config(family, tmp_path):
    model = family_decoder(family)
    layout = layout_of(model)
    assert layout.name == model.config.model_type
    width, layers = mlp_width(model), len(layout.decoder_layers(model))
    blocks = random_blocks(2, 12, seed=1)
    if layout.mlp_width_key is None:  # e.g. BLOOM: 4 x hidden, no key; said, and only layers are cut
        assert any("MLP neurons" in c for c in layout.cannot_cut)
        with pytest.raises(ConfigError, match="cannot|no config key"):
            D.prune_mlp_(model, width // 2, None, "magnitude", reconstruct=False)
        D.drop_layers_(model, D.calibrate(model, random_blocks(4, 16)), 1)
    else:
        _cut(model)
        assert mlp_width(model) == width // 2
    assert len(layout.decoder_layers(model)) == layers - 1
    rebuilt = D.rebuild(model)  # the config alone describes the cut model
    torch.testing.assert_close(_logits(rebuilt, blocks), _logits(model, blocks))
    save_causal_lm(model, tiny_tokenizer(), tmp_path / "cut")
    reloaded, _ = load_causal_lm(tmp_path / "cut")
    torch.testing.assert_close(_logits(reloaded, blocks), _logits(model, blocks))


@pytest.mark.parametrize("family", SERVED_FAMILIES + TORCH_ONLY_FAMILIES)
def test_a_no_op_cut_keeps_every_greedy_token(family):
    model = family_decoder(family)
    before = _greedy(model)
    layout = layout_of(model)
    if layout.mlp_width_key is not None:
        D.prune_mlp_(model, mlp_width(model), None, "magnitude", reconstruct=False)  # every neuron kept, sliced
    if layout.attention is not None and layout.head_dim_key is not None:
        kv = model.config.num_key_value_heads
        D.prune_heads_(model, kv, model.config.num_attention_heads // kv, None, reconstruct=False)
    assert torch.equal(_greedy(D.rebuild(model)), before)


_FAST = ("llama", "qwen3", "gemma3_text")  # GQA; q/k norms; sliding and global layers: the rest under -m slow


@pytest.mark.parametrize(
    "family",
    [
        f if f in _FAST else pytest.param(f, marks=pytest.mark.slow(reason="one onnxruntime-genai build, ~8 s"))
        for f in SERVED_FAMILIES
    ],
)
def test_the_cut_model_of_every_served_family_exports_with_the_same_greedy_tokens(family, tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from pruneops.runtimes.genai.generation import build_genai_model, exported_block_losses, greedy_tokens

    model = _cut(family_decoder(family))
    hf = save_causal_lm(model, tiny_tokenizer(), tmp_path / "hf")
    exported = build_genai_model(hf, tmp_path / "fp32", "fp32", threads=1)
    tokens = greedy_tokens(exported, PROMPT.numpy(), NEW_TOKENS)
    assert np.asarray(tokens).tolist() == _greedy(model).tolist()
    # Random models often repeat one token: the per-block losses the gates and the benchmark read agree too,
    # to fp32 summation order (Gemma's random logits reach hundreds: 1.3e-4 relative measured, 4x that allowed).
    blocks = random_blocks(3, 16, seed=7)
    ours = exported_block_losses(exported, blocks.numpy(), threads=1)
    np.testing.assert_allclose(ours, block_losses(model, blocks), rtol=5e-4)


def test_a_model_pruning_cannot_handle_is_refused_naming_what():
    from transformers import MixtralConfig, MixtralForCausalLM

    experts = MixtralForCausalLM(
        MixtralConfig(hidden_size=16, intermediate_size=8, num_hidden_layers=2, num_attention_heads=2,
                      num_key_value_heads=1, num_local_experts=2, vocab_size=50)
    )  # fmt: skip
    with pytest.raises(ConfigError, match="routes tokens to experts .*dense MLPs only"):
        layout_of(experts)
    uneven = family_decoder("llama")
    down = uneven.model.layers[1].mlp.down_proj
    uneven.model.layers[1].mlp.down_proj = torch.nn.Linear(48, down.out_features, bias=False)
    with pytest.raises(ConfigError, match="decoder layer 1 differs from layer 0 .*mlp.down_proj"):
        layout_of(uneven)
