"""GGUF export (llama.cpp's converter and quantizer) read back with the model's logits; llama.cpp as a runtime.

The GGUF tests need the converter (`make gguf-converter`) and a tokenizer llama.cpp's converter knows
(SmolLM2's, `make llm-assets`); the runtime tests also need llama-cpp-python (`make llama-cpp`).
Each skips, saying which, where it is missing.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("gguf", reason="the llm extra (gguf) is not installed")

from pruneops.core.errors import PruneOpsError  # noqa: E402
from pruneops.runtimes import get_runtime  # noqa: E402
from pruneops.runtimes.llamacpp.export import (  # noqa: E402
    CONVERTER_FILE,
    LOAD_CHECK_FILE,
    check_loaded_back,
    converter_path,
)
from tests.decoder_helpers import family_decoder  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
SMOLLM2 = ROOT / "assets" / "llm" / "smollm2-135m"
CONVERTER = Path(os.environ.get("PRUNEOPS_LLAMA_CPP") or Path(sys.prefix) / "share" / "llama.cpp") / CONVERTER_FILE
needs_converter = pytest.mark.skipif(
    not CONVERTER.is_file() or not (SMOLLM2 / "tokenizer.json").is_file(),
    reason="needs llama.cpp's converter (`make gguf-converter`) and SmolLM2's tokenizer (`make llm-assets`)",
)
try:
    import llama_cpp  # noqa: F401

    HAVE_LLAMA_CPP = True
except ImportError:
    HAVE_LLAMA_CPP = False
needs_llama_cpp = pytest.mark.skipif(not HAVE_LLAMA_CPP, reason="llama-cpp-python is not built (`make llama-cpp`)")


@pytest.fixture(scope="module")
def tokenizer():
    from pruneops.models.decoders import load_causal_tokenizer

    return load_causal_tokenizer(SMOLLM2)


@pytest.fixture(scope="module")
def llama_gguf(tmp_path_factory, tokenizer):
    """A tiny random Llama with SmolLM2's 49,152-token vocabulary, written in fp32, F16 and Q8_0."""
    model = family_decoder("llama", layers=2, vocab_size=len(tokenizer)).eval()
    out = get_runtime("llamacpp").export(model, tmp_path_factory.mktemp("gguf"), ["fp32", "f16", "q8_0"],
                                         tokenizer=tokenizer)  # fmt: skip
    return model, out


@needs_converter
def test_every_format_reads_back_with_the_logits_of_the_model_rounded_as_it_rounds(llama_gguf):
    model, out = llama_gguf
    runtime = get_runtime("llamacpp")
    assert set(out) == {"fp32", "f16", "q8_0"} and all(runtime.recognises(p) for p in out.values())
    with torch.inference_mode():
        scale = 1.0 + float(model(torch.arange(16)[None]).logits.abs().max())
    # What the export's own read-back (`check_loaded_back`, run on every file it writes) measured.
    errors = {
        p: json.loads((folder / LOAD_CHECK_FILE).read_text())["largest_logit_difference"] for p, folder in out.items()
    }
    assert errors["fp32"] < 1e-3 * scale and errors["f16"] < 1e-3 * scale and errors["q8_0"] < 1e-3 * scale
    sizes = {p: (folder / "model.gguf").stat().st_size for p, folder in out.items()}
    # F16 halves fp32's matrices; Q8_0 stores 34 bytes per 32 weights (vectors and metadata aside).
    assert sizes["f16"] / sizes["fp32"] == pytest.approx(0.5, abs=0.05)
    assert sizes["q8_0"] / sizes["fp32"] == pytest.approx(34 / 128, abs=0.05)


@needs_converter
def test_a_file_that_holds_other_weights_fails_the_check(llama_gguf):
    model, out = llama_gguf
    other = family_decoder("llama", layers=2, seed=1, vocab_size=model.config.vocab_size).eval()
    with pytest.raises(PruneOpsError, match="gives other logits than the model"):
        check_loaded_back(other, out["fp32"] / "model.gguf", "fp32")


@needs_converter
@pytest.mark.slow  # reason: two families x three formats through the converter (about 60 s)
@pytest.mark.parametrize("family", ["qwen3", "gemma3_text"])  # q/k norms; sliding and global layers
def test_families_with_q_k_norms_and_sliding_layers_read_back(family, tokenizer, tmp_path):
    model = family_decoder(family, layers=2, vocab_size=len(tokenizer)).eval()
    out = get_runtime("llamacpp").export(model, tmp_path, ["fp32", "q8_0"], tokenizer=tokenizer)
    assert set(out) == {"fp32", "q8_0"} and not (tmp_path / "hf").exists()


def test_a_missing_converter_is_one_line_naming_the_make_target(tmp_path, monkeypatch):
    monkeypatch.setenv("PRUNEOPS_LLAMA_CPP", str(tmp_path))
    with pytest.raises(PruneOpsError, match=r"make llama-cpp"):
        converter_path()


@needs_converter
@needs_llama_cpp
@pytest.mark.slow(reason="Q4_K_M made, scored, generated and timed beside onnxruntime-genai (about 20 s)")
def test_llama_cpp_quantizes_scores_generates_and_times_the_export(llama_gguf, tokenizer, tmp_path):
    from pruneops.data.zero_shot import answer_losses
    from pruneops.models.language import block_losses
    from pruneops.timing.generation import DecodeWorkload, time_interleaved

    model, out = llama_gguf
    runtime = get_runtime("llamacpp")
    q4 = runtime.export(model, tmp_path, ["q4_k_m"], tokenizer=tokenizer)["q4_k_m"]
    assert (q4 / "model.gguf").stat().st_size < (out["q8_0"] / "model.gguf").stat().st_size
    blocks = np.random.default_rng(0).integers(0, model.config.vocab_size, (2, 24))
    opened = runtime.open(out["fp32"])
    reference = block_losses(model, torch.as_tensor(blocks))
    np.testing.assert_allclose(opened.losses(blocks), reference, rtol=1e-3)
    context, answers = blocks[1, :8].tolist(), [[3], [4]]  # the zero-shot check's answers: one prefill for both
    alone = [float(opened.token_losses(np.asarray(context + a))[len(context) - 1 :].sum()) for a in answers]
    assert answer_losses(opened, context, answers) == pytest.approx(alone, rel=1e-4)
    prompt = blocks[:1, :8]
    greedy = opened.greedy(prompt, 6)
    generation = opened.start(prompt[0].tolist(), max_length=14)
    assert [generation.step() for _ in range(6)] == greedy[0].tolist()
    timings = runtime.time({"fp32": out["fp32"], "q4_k_m": q4}, DecodeWorkload(prompt, new_tokens=4, rounds=2))
    assert set(timings) == {"fp32", "q4_k_m"} and all(t.tpot_ms > 0 and t.batch == 1 for t in timings.values())
    genai = get_runtime("genai")
    folder = genai.export(model, tmp_path / "genai", ["fp32"], tokenizer=tokenizer)["fp32"]
    both = time_interleaved({"genai": genai.open(folder), "llamacpp": opened}, DecodeWorkload(prompt, 4, 2))
    assert set(both) == {"genai", "llamacpp"}
    assert runtime.contract(out["fp32"], {})["num_classes"] == model.config.vocab_size
