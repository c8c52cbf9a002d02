"""Which runtimes serve a causal LM (`export.runtime`), resolved once by `train`; `auto` ships the fastest in budget.

The end-to-end tests need llama.cpp's converter and llama-cpp-python (`make llama-cpp`) and SmolLM2's
tokenizer (`make llm-assets`: a tokenizer llama.cpp's converter knows); each skips saying which is missing.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.task.causal_lm import common  # noqa: E402
from tests.conftest import write_params  # noqa: E402
from tests.decoder_helpers import decoder_params, family_decoder, speeches  # noqa: E402
from tests.runtimes.test_llamacpp import SMOLLM2, needs_converter, needs_llama_cpp  # noqa: E402

MODEL = SimpleNamespace(config=SimpleNamespace(model_type="olmo2"))


def _refusing(monkeypatch, **reasons: str | None) -> None:
    for name, reason in reasons.items():
        monkeypatch.setattr(common.DECODER_RUNTIMES[name], "cannot_serve", lambda model, tokenizer, r=reason: r)


def test_auto_keeps_every_runtime_that_serves_the_family_and_records_why_another_cannot(monkeypatch):
    _refusing(monkeypatch, genai="the builder refuses it", llamacpp=None)
    choice = common.resolve_runtimes("auto", MODEL, None)
    assert choice.servable == ("llamacpp",) and choice.planning is common.LLAMACPP
    assert choice.refused == {"genai": "the builder refuses it"}
    assert "genai cannot: the builder refuses it" in choice.describe()
    _refusing(monkeypatch, genai=None)
    assert common.resolve_runtimes("auto", MODEL, None).servable == ("genai", "llamacpp")  # preference order


def test_a_runtime_asked_by_name_is_the_only_one_probed(monkeypatch):
    _refusing(monkeypatch, genai=None, llamacpp="never asked")
    assert common.resolve_runtimes("genai", MODEL, None) == common.RuntimeChoice("genai", ("genai",), {})


def test_no_runtime_that_serves_the_family_is_one_line_with_each_reason(monkeypatch):
    _refusing(monkeypatch, genai="the builder refuses it", llamacpp="llama-cpp-python is not built here")
    with pytest.raises(ConfigError) as err:
        common.resolve_runtimes("auto", MODEL, None)
    message = str(err.value)
    assert "\n" not in message and "olmo2" in message
    assert "genai: the builder refuses it" in message and "llamacpp: llama-cpp-python is not built" in message


def test_an_unknown_runtime_is_refused_when_the_params_load():
    from pruneops.pipeline.stages import load_configs

    params = decoder_params(Path("model"), Path("corpus.txt"), export={"runtime": "vllm"})
    with pytest.raises(
        ConfigError, match=r"export.runtime: unknown runtime .vllm.; choose auto or one of genai, llamacpp"
    ):
        load_configs(params)


# Families onnxruntime-genai's builder (0.18) refuses or builds wrongly that llama.cpp converts and
# computes as transformers does: through `auto` they are exported, timed and served by llama.cpp.
LLAMA_CPP_ONLY = ("olmo", "olmo2", "cohere", "starcoder2", "stablelm", "bloom")


@needs_converter
@needs_llama_cpp
@pytest.mark.slow(reason="twelve family probes, each a converter run and a builder run (about 90 s)")
@pytest.mark.parametrize("family", LLAMA_CPP_ONLY)
def test_llama_cpp_serves_families_the_genai_builder_cannot(family):
    from pruneops.models.decoders import load_causal_tokenizer

    tokenizer = load_causal_tokenizer(SMOLLM2)
    model = family_decoder(family, layers=2, vocab_size=len(tokenizer)).eval()
    assert common.GENAI.cannot_serve(model, tokenizer=tokenizer) is not None
    assert common.LLAMACPP.cannot_serve(model, tokenizer=tokenizer) is None


def _project(root: Path, family: str, **overrides: dict) -> Path:
    """A tiny `family` decoder with SmolLM2's tokenizer and a corpus of speeches, as a user's project holds them."""
    from pruneops.models.decoders import load_causal_tokenizer, save_causal_lm

    tokenizer = load_causal_tokenizer(SMOLLM2)
    model = family_decoder(family, layers=4, vocab_size=len(tokenizer), hidden_size=256, intermediate_size=1536)
    save_causal_lm(model.eval(), tokenizer, root / "model")
    (root / "corpus.txt").write_text("\n\n".join(speeches(60)))
    params = decoder_params(root / "model", root / "corpus.txt", **overrides)
    params["prune"]["target"] = {"kind": "latency_ratio", "value": 0.9}  # the 49k-row head is half its time
    params["benchmark"] = {**params["benchmark"], "new_tokens": 16, "rounds": 3}
    return write_params(root, params)


def _run_all(params: Path, root: Path, monkeypatch) -> None:
    """Every stage in this process, the latency table's fit injected (a tiny model's timings are noise to it)."""
    from pruneops.pipeline.runner import run_stage
    from pruneops.pipeline.stages import STAGE_NAMES
    from pruneops.planning.decode_cost import DecodeCostModel
    from pruneops.task.causal_lm import latency

    def proportional(table):  # half of dense's measured time fixed, half in proportion to its weights
        shape, timing = table[0]
        return {
            metric: DecodeCostModel(intercept_ms=ms / 2, slope_ms=ms / 2 / shape.layer_weights, residual_ms=0.0)
            for metric, ms in (("decode", timing.tpot_ms), ("prefill", timing.ttft_ms))
        }

    monkeypatch.setattr(latency, "fit_costs", proportional)
    for stage in STAGE_NAMES:
        run_stage(stage, params, root)


@needs_converter
@needs_llama_cpp
@pytest.mark.slow(reason="every stage of a decoder with a 49k vocabulary in two runtimes (about 3 min)")
def test_auto_ships_the_fastest_candidate_of_either_runtime_within_the_budgets(tmp_path, monkeypatch):
    from pruneops.core.io import Layout

    params = _project(tmp_path, "llama", export={"runtime": "auto"}, quantize={"gguf_precisions": ["q8_0"]})
    _run_all(params, tmp_path, monkeypatch)
    layout = Layout(tmp_path)
    runtimes = json.loads((layout.stage_dir("train") / "runtimes.json").read_text())
    assert runtimes["servable"] == ["genai", "llamacpp"]
    choice = json.loads((layout.stage_dir("quantize") / "precision.json").read_text())
    candidates = choice["candidates"]
    assert {c["runtime"] for c in candidates.values()} == {"genai", "llamacpp"}
    assert {"fp32", "int8", "llamacpp fp32", "llamacpp q8_0"} <= set(candidates)
    ceiling = candidates["fp32"]["val_perplexity"] * 1.05  # quantize.perplexity_tolerance's default
    within = {n: c for n, c in candidates.items() if c["within_budget"] and c["val_perplexity"] <= ceiling}
    fastest = min(within, key=lambda n: within[n]["tpot_b1_ms"])
    assert (choice["runtime"], choice["precision"]) == (within[fastest]["runtime"], within[fastest]["precision"])
    manifest = json.loads((layout.stage_dir("export") / "manifest.json").read_text())
    assert manifest["runtime"] == choice["runtime"] == manifest["models"]["pruned_deployed"]["runtime"]
    results = json.loads((layout.stage_dir("benchmark") / "results.json").read_text())
    assert set(results["rows"]) == set(manifest["models"])
    for row in results["rows"].values():  # every row timed at batch 1; llama.cpp's rows sit batch 2 out
        assert row["tpot_b1_ms"] > 0 and ("tpot_b2_ms" in row) == (row["runtime"] == "genai")


@needs_converter
@needs_llama_cpp
@pytest.mark.slow(reason="every stage of a decoder with a 49k vocabulary, in llama.cpp (about 2 min)")
def test_a_family_the_genai_builder_cannot_build_is_pruned_timed_and_served_by_llama_cpp(tmp_path, monkeypatch):
    from pruneops.core.io import Layout
    from pruneops.modelstore.decoder import check_decoder_runs
    from pruneops.serving.generate import DecoderService, GenerateRequest

    params = _project(tmp_path, "olmo2", export={"runtime": "auto"}, quantize={"gguf_precisions": ["q8_0"]})
    _run_all(params, tmp_path, monkeypatch)
    layout = Layout(tmp_path)
    runtimes = json.loads((layout.stage_dir("train") / "runtimes.json").read_text())
    assert runtimes["servable"] == ["llamacpp"] and "genai" in runtimes["refused"]
    cost = json.loads((layout.stage_dir("latency") / "decode_cost.json").read_text())
    assert "llama_cpp_python" in cost["machine"]  # the latency table was timed in llama.cpp
    manifest = json.loads((layout.stage_dir("export") / "manifest.json").read_text())
    assert {m["runtime"] for m in manifest["models"].values()} == {"llamacpp"}
    served = layout.stage_dir("export") / "model"
    _, vocab = check_decoder_runs(served)
    assert vocab == json.loads((tmp_path / "model" / "config.json").read_text())["vocab_size"]
    service = DecoderService(served, reference=None)
    answer = service.generate(GenerateRequest(prompt="We the people", max_new_tokens=4))
    assert answer.tokens == 4 or answer.finish_reason == "eos"
    assert np.isfinite(json.loads((layout.stage_dir("benchmark") / "results.json").read_text())["rows"]
                       ["pruned_deployed"]["test_perplexity"])  # fmt: skip
