"""LoRA recovery: adapters on every decoder-layer projection, trained alone, merged back into the weights."""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.training.recovery import LoRAProjection, RecoverySettings, attach_lora_, detach_lora_, recover_  # noqa: E402
from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402
from tests.training.test_recovery import _kl_to, _student_with_half_its_mlp  # noqa: E402

FAMILIES = ["llama", "qwen2", "gpt_neox", "gpt2"]  # nn.Linear projections, and GPT-2's transposed Conv1D


def _logits(model, blocks):
    with torch.inference_mode():
        return model(input_ids=blocks).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_adapters_start_as_the_identity_and_merge_into_the_same_function(family):
    model, blocks = tiny_decoder(family), random_blocks(2, 12, seed=3)
    dense = _logits(model, blocks)
    attached = attach_lora_(model, rank=2, alpha=4.0)
    adapter_weights = {id(p) for *_, a in attached.adapters for p in (a.lora_a, a.lora_b)}
    assert len(attached.adapters) >= 4 * 4  # q/k/v/o or fused attention, and the MLP, in each of 4 layers
    assert all(p.requires_grad == (id(p) in adapter_weights) for p in model.parameters())  # the rest frozen
    assert torch.equal(_logits(model, blocks), dense)  # B starts at zero
    for *_, adapter in attached.adapters:
        torch.nn.init.normal_(adapter.lora_b, std=0.05)
    adapted = _logits(model, blocks)
    assert (adapted - dense).abs().max() > 1e-3  # the adapters change the function
    detach_lora_(attached, merge=True)
    assert not any(isinstance(m, LoRAProjection) for m in model.modules())
    merged = _logits(model, blocks)
    # merging reorders one float32 sum per weight: a rounding-sized difference of logits of order 1
    assert (merged - adapted).abs().max() < 1e-4 * max(1.0, float(adapted.abs().max()))


def test_lora_recovery_trains_the_adapters_alone_and_leaves_the_cut_model_shape_and_flags():
    teacher, student, train, held_out = _student_with_half_its_mlp()
    before_kl = _kl_to(teacher, student, held_out)
    embedding = student.model.embed_tokens.weight.detach().clone()
    norms = [layer.input_layernorm.weight.detach().clone() for layer in student.model.layers]
    shapes = {n: p.shape for n, p in student.named_parameters()}
    settings = RecoverySettings(max_tokens=120 * 16, batch_blocks=4, lr=3e-3, lora_rank=4, lora_alpha=8.0)
    result = recover_(student, teacher, train, settings)
    projections = [m for layer in student.model.layers for m in layer.modules() if isinstance(m, torch.nn.Linear)]
    assert result.trained_parameters == sum(4 * sum(m.weight.shape) for m in projections)  # A: r x in, B: out x r
    assert {n: p.shape for n, p in student.named_parameters()} == shapes  # merged back: the same modules
    assert all(p.requires_grad for p in student.parameters())  # flags as they were
    assert torch.equal(student.model.embed_tokens.weight, embedding)  # frozen: only projections changed
    assert all(torch.equal(x.input_layernorm.weight, n) for x, n in zip(student.model.layers, norms, strict=True))
    assert _kl_to(teacher, student, held_out) < 0.8 * before_kl


def test_a_failed_lora_run_leaves_the_student_as_it_was(monkeypatch):
    import pruneops.training.recovery as R

    teacher, student, train, _ = _student_with_half_its_mlp()
    original = copy.deepcopy(student.state_dict())

    def fail(*args, **kwargs):
        raise RuntimeError("out of memory")

    monkeypatch.setattr(R, "_train", fail)
    with pytest.raises(RuntimeError, match="out of memory"):
        recover_(student, teacher, train, RecoverySettings(max_tokens=64, lora_rank=2))
    state = student.state_dict()
    assert state.keys() == original.keys() and all(torch.equal(state[k], original[k]) for k in state)
    assert all(p.requires_grad for p in student.parameters())


def test_a_rank_as_wide_as_a_projection_is_refused():
    model = tiny_decoder("llama")
    narrowest = min(min(m.weight.shape) for m in model.model.layers[0].modules() if isinstance(m, torch.nn.Linear))
    with pytest.raises(ConfigError, match=rf"finetune.lora_rank: {narrowest} is not below the width"):
        attach_lora_(model, rank=narrowest, alpha=1.0)
    assert all(p.requires_grad for p in model.parameters())  # refused before anything changed
