"""studies/gpu/measure_decoder_gpu.py on a tiny decoder: its static-cache step against transformers' own."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

pytest.importorskip("transformers")

from tests.conftest import ROOT  # noqa: E402
from tests.decoder_helpers import tiny_decoder  # noqa: E402


def _script():
    spec = importlib.util.spec_from_file_location("measure_decoder_gpu", ROOT / "studies/gpu/measure_decoder_gpu.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_static_cache_step_decodes_the_tokens_transformers_generate_does(family):
    script = _script()
    model = tiny_decoder(family)
    prompt = torch.randint(3, 40, (2, 7), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        expected = model.generate(prompt, max_new_tokens=6, do_sample=False, min_new_tokens=6)[:, 7:]
    eager = script.generate_eager(model, prompt, 6)
    static = script.GraphDecoder(model, 2, 7, 6, torch.device("cpu")).generate(prompt, 6)
    assert torch.equal(eager.tokens, expected) and torch.equal(static.tokens, expected)
    assert len(eager.tpot_s) == len(static.tpot_s) == 5 and min(eager.tpot_s + static.tpot_s) > 0


def test_every_model_dtype_mode_and_batch_gets_a_row_and_the_warm_up_round_is_dropped():
    script = _script()
    dense = tiny_decoder("llama")
    base = script.shape_of(dense.config)
    narrow = script.cut_for_timing(dense, script.parse_shape("1:16:1", base))
    assert script.shape_of(narrow.config).describe() == f"1 layers, MLP 16, 1x{base.queries_per_group} heads"
    prompts = {b: torch.randint(3, 40, (b, 5)) for b in (1, 2)}
    rows = script.time_on_device({"dense": dense, "narrow": narrow}, prompts, 3, 2, torch.device("cpu"))
    keys = {(r["model"], r["dtype"], r["mode"], r["batch"]) for r in rows}
    assert keys == {
        (m, d, k, b) for m in ("dense", "narrow") for d in ("fp32", "bf16") for k in ("eager", "graph") for b in (1, 2)
    }
    fp32 = [r for r in rows if r["dtype"] == "fp32"]
    assert all(r["ttft_ms"] > 0 and r["tpot_ms"] > 0 for r in rows)
    assert all(r["rows_greedy_equal_to_eager"] == r["batch"] for r in fp32)


def test_the_markdown_gives_one_row_per_model_and_dtype_with_graph_speed_ups_over_dense():
    script = _script()
    dense = tiny_decoder("llama")
    shallow = script.cut_for_timing(dense, script.parse_shape("1:32:1", script.shape_of(dense.config)))
    prompts = {1: torch.randint(3, 40, (1, 5))}
    rows = script.time_on_device({"dense": dense, "1:32:1": shallow}, prompts, 3, 1, torch.device("cpu"))
    report = {"machine": {"gpu": "none"}, "latency_weights": "random", "latency": rows}
    report["shapes"] = {"dense": "2 layers", "1:32:1": "1 layer"}
    table = [line for line in script.render([report]).splitlines() if line.startswith("| dense |")]
    assert len(table) == 2 and all(line.endswith("| 1.00× |") for line in table)  # fp32 and bf16, each against itself
    graph = {(r["model"], r["dtype"]): r["tpot_ms"] for r in rows if r["mode"] == "graph"}
    assert f"| {graph[('dense', 'fp32')] / graph[('1:32:1', 'fp32')]:.2f}× |" in script.render([report])
