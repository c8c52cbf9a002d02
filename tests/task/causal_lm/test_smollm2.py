"""The real asset: SmolLM2-135M-Instruct (`make llm-assets`), exported and decoded as it is served."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

ROOT = Path(__file__).resolve().parents[3]
SMOLLM2 = ROOT / "assets" / "llm" / "smollm2-135m"
GGUF = ROOT / "assets" / "llm" / "SmolLM2-135M-Instruct.Q4_1.gguf"
SPEECHES = ROOT / "assets" / "llm" / "political_data.csv"

pytestmark = pytest.mark.skipif(not (SMOLLM2 / "config.json").is_file(), reason="run `make llm-assets` first")


# ~60 s: one onnxruntime-genai export of a 135M model and 64 greedy steps in torch and in the runtime.
@pytest.mark.slow
def test_exported_smollm2_decodes_greedy_tokens_identical_to_torch_for_64_steps(tmp_path):
    from pruneops.data.corpus import read_documents
    from pruneops.models.decoders import load_causal_lm
    from pruneops.runtimes.genai.generation import build_genai_model, greedy_tokens

    model, tokenizer = load_causal_lm(SMOLLM2)
    text = read_documents(SPEECHES)[0]
    prompt = torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"][:64]])
    expected = model.generate(
        prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=64, min_new_tokens=64, do_sample=False
    )[:, 64:]
    exported = greedy_tokens(build_genai_model(SMOLLM2, tmp_path / "fp32", "fp32", threads=2), prompt.numpy(), 64)
    np.testing.assert_array_equal(exported, expected.numpy())


@pytest.mark.slow
@pytest.mark.skipif(not GGUF.is_file(), reason="run `make llm-assets` first")
def test_the_gguf_file_loads_to_the_same_weights_as_the_saved_folder():
    from pruneops.models.decoder_layout import layout_of
    from pruneops.models.decoders import load_causal_lm

    from_gguf, tokenizer = load_causal_lm(GGUF)
    from_folder, _ = load_causal_lm(SMOLLM2)
    assert layout_of(from_gguf).name == "llama" and from_gguf.config.num_key_value_heads == 3
    assert not hasattr(from_gguf.config, "quantization_config")
    for (name, a), (_, b) in zip(from_gguf.state_dict().items(), from_folder.state_dict().items(), strict=True):
        assert torch.equal(a, b), name
    assert tokenizer.eos_token_id is not None
