"""scripts/measure_heterogeneous_widths.py: its allocation, per-layer cut and MLP timing on a tiny Llama."""

from __future__ import annotations

import copy
import importlib.util

import pytest
import torch

from tests.conftest import ROOT
from tests.llm.decoder_helpers import random_blocks, tiny_decoder

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def script():
    spec = importlib.util.spec_from_file_location("hetero", ROOT / "scripts/measure_heterogeneous_widths.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_allocations_keep_the_uniform_total_in_steps_and_follow_the_scores(script):
    g = torch.Generator().manual_seed(0)
    # Layer 0's scores are ten times the others': by raw mean it would take everything.
    scores = [torch.rand(512, generator=g) * (10.0 if i == 0 else 1.0) for i in range(6)]
    scores[3][:256] += 5.0  # layer 3: half its neurons stand out
    for normalise in ("standardised", "mean-normalised"):
        widths = script.allocate(scores, 256 * 6, normalise)
        assert sum(widths) == 256 * 6 and all(w % script.STEP == 0 and 64 <= w <= 512 for w in widths)
    assert script.allocate(scores, 256 * 6, "mean-normalised")[0] < 512  # normalised per layer: no layer hoards


def test_the_per_layer_cut_keeps_each_layers_width_and_equals_the_uniform_cut_when_widths_are_equal(script):
    from pruneops.pruning import decoder as cuts

    dense = tiny_decoder("llama", intermediate_size=128)
    blocks = random_blocks(8)
    calibration = cuts.calibrate(dense, blocks)
    scores = script.layer_scores(dense, calibration)
    model = script.cut_per_layer(dense, calibration, scores, [64, 128, 64, 128])
    assert [layer.mlp.down_proj.in_features for layer in model.model.layers] == [64, 128, 64, 128]
    uniform = script.cut_per_layer(dense, calibration, scores, [64] * 4)
    ref = copy.deepcopy(dense)
    cuts.prune_mlp_(ref, 64, calibration, "activation", True)
    with torch.inference_mode():
        assert torch.allclose(uniform(input_ids=blocks).logits, ref(input_ids=blocks).logits, atol=1e-5)
        assert torch.isfinite(model(input_ids=blocks).logits).all()


def test_mlp_step_times_are_measured_per_width(script):
    pytest.importorskip("onnxruntime")
    step = script.mlp_step_seconds(64, [64, 128, 64], rounds=2, calls=20)
    assert set(step) == {64, 128} and all(0 < s < 0.1 for s in step.values())
