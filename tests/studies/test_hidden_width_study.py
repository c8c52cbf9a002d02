"""studies/decoder/measure_decoder_hidden_width.py: the hidden-width cut it measures is a model the config expresses."""

from __future__ import annotations

import copy
import importlib.util
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402

SCRIPT = Path(__file__).resolve().parents[2] / "studies" / "decoder" / "measure_decoder_hidden_width.py"


def _script():
    spec = importlib.util.spec_from_file_location("measure_decoder_hidden_width", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_full_width_cut_is_the_model_and_a_narrower_one_reloads_and_exports(tmp_path):
    from pruneops.models.language import block_losses
    from pruneops.planning.decode_cost import shape_of, width_step
    from pruneops.pruning.decoder_cuts import rebuild

    script = _script()
    dense = tiny_decoder("llama")
    blocks = random_blocks(8)
    importance, energy = script.channel_statistics(dense, blocks)
    hidden = dense.config.hidden_size
    same = copy.deepcopy(dense)
    script.cut_hidden_(same, hidden, importance, energy)  # every channel kept: the rescale is 1
    with torch.inference_mode():
        assert torch.allclose(same(input_ids=blocks).logits, dense(input_ids=blocks).logits, atol=1e-5)
    narrow = copy.deepcopy(dense)
    width = hidden * 3 // 4
    script.cut_hidden_(narrow, width, importance, energy)
    reloaded = rebuild(narrow)  # strict load into a model built from the changed config
    shape = shape_of(reloaded.config)
    assert shape.hidden == width and shape.head_dim == shape_of(dense.config).head_dim
    assert reloaded.lm_head.weight.data_ptr() == reloaded.model.embed_tokens.weight.data_ptr()
    assert torch.isfinite(torch.as_tensor(block_losses(reloaded, blocks))).all()
    # onnxruntime-genai's builder takes it (q/k/v wider than the stream): greedy tokens as torch's.
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from pruneops.runtimes.genai.export import export_model as export_genai
    from pruneops.runtimes.genai.generation import greedy_tokens
    from tests.decoder_helpers import tiny_tokenizer

    folder = export_genai(reloaded, tiny_tokenizer(), tmp_path, ["fp32"], 1)["fp32"]
    prompt = blocks[:1, :12]
    expected = reloaded.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=8, min_new_tokens=8, do_sample=False
    )[:, 12:]
    assert greedy_tokens(folder, prompt.numpy(), 8).tolist() == expected.tolist()
    # Its per-token weights are those the matching MLP width reads, within one width step.
    dense_shape = shape_of(dense.config)
    mlp_shape = replace(dense_shape, mlp_width=script.matching_mlp_width(dense, width))
    step = dense_shape.layers * dense_shape.mlp_projections * dense_shape.hidden * width_step(dense_shape.mlp_width)
    cut_weights = shape.layer_weights + shape.output_weights
    assert abs(mlp_shape.layer_weights + mlp_shape.output_weights - cut_weights) <= step / 2 + 1
