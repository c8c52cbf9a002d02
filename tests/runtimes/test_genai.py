"""Decode latency where it serves: onnxruntime-genai's builder and generation loop on a tiny Llama."""

from __future__ import annotations

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

from pruneops.core.errors import PruneOpsError  # noqa: E402
from pruneops.runtimes.genai.generation import build_genai_model, greedy_tokens, time_generation  # noqa: E402
from tests.decoder_helpers import random_blocks, save_tiny  # noqa: E402


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    root = tmp_path_factory.mktemp("genai")
    hf = save_tiny("llama", root / "hf")
    return hf, build_genai_model(hf, root / "onnx", "fp32", threads=1)


def test_exported_greedy_tokens_equal_torch_for_every_step(built):
    from transformers import AutoModelForCausalLM

    hf, onnx = built
    prompt = random_blocks(2, 8, seed=5)
    model = AutoModelForCausalLM.from_pretrained(hf).eval()
    steps = 24
    expected = model.generate(
        prompt,
        attention_mask=torch.ones_like(prompt),
        max_new_tokens=steps,
        min_new_tokens=steps,
        do_sample=False,
        pad_token_id=2,
    )[:, 8:]
    exported = greedy_tokens(onnx, prompt.numpy(), steps)
    assert exported.shape == (2, steps)
    np.testing.assert_array_equal(exported, expected.numpy())


def test_timing_reports_every_model_at_the_batch_and_length_asked(built):
    _, onnx = built
    prompt = random_blocks(4, 12, seed=6).numpy()
    timings = time_generation({"a": onnx, "b": onnx}, prompt, new_tokens=8, rounds=3)
    assert set(timings) == {"a", "b"}
    for timing in timings.values():
        assert timing.batch == 4 and timing.prompt_length == 12 and len(timing.tpot_rounds_ms) == 3
        assert 0 < timing.tpot_ms < timing.ttft_ms * 50 and timing.tokens_per_second == pytest.approx(
            1000 / timing.tpot_ms
        )


def test_a_folder_the_builder_cannot_read_is_one_line(tmp_path):
    (tmp_path / "hf").mkdir()
    (tmp_path / "hf" / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(PruneOpsError, match="builder failed"):
        build_genai_model(tmp_path / "hf", tmp_path / "out")
    with pytest.raises(PruneOpsError, match="not one of"):
        build_genai_model(tmp_path / "hf", tmp_path / "out", precision="int3")


def test_exported_perplexity_matches_torch_in_fp32(built):
    from transformers import AutoModelForCausalLM

    from pruneops.models.language import block_losses
    from pruneops.runtimes.genai.generation import exported_block_losses

    hf, onnx = built
    blocks = random_blocks(3, 20, seed=7)
    expected = block_losses(AutoModelForCausalLM.from_pretrained(hf).eval(), blocks)
    np.testing.assert_allclose(exported_block_losses(onnx, blocks.numpy()), expected, rtol=1e-4)


def test_a_sliding_window_longer_than_the_generation_is_probed_timed_and_served(tmp_path):
    # Gemma 3 270M's local window is 512 tokens, longer than a probe's 8 + 8 tokens or a timing's
    # 256 + 32: onnxruntime-genai refuses a KV cache shorter than the window ("KV cache capacity
    # (16) must be at least local_window_size (512)"), so the cache is sized to the window while the
    # generation stops where it was asked to.
    from pruneops.models.decoders import save_causal_lm
    from pruneops.runtimes.genai import GenaiModel
    from pruneops.runtimes.genai.export import family_problem
    from pruneops.runtimes.genai.generation import GenaiTimed
    from tests.decoder_helpers import family_decoder, tiny_tokenizer

    model = family_decoder("gemma3_text", layers=2).eval()
    model.config.sliding_window, model.config.max_position_embeddings = 512, 32768  # Gemma 3 270M's
    tokenizer = tiny_tokenizer()
    assert family_problem(model, tokenizer) is None
    folder = build_genai_model(save_causal_lm(model, tokenizer, tmp_path / "hf"), tmp_path / "fp32", "fp32", threads=1)
    prompt = random_blocks(1, 8, seed=5)
    greedy = {"max_new_tokens": 8, "min_new_tokens": 8, "do_sample": False, "pad_token_id": 2}
    expected = model.generate(prompt, attention_mask=torch.ones_like(prompt), **greedy)[:, 8:]
    np.testing.assert_array_equal(greedy_tokens(folder, prompt.numpy(), 8), expected.numpy())
    assert GenaiTimed(folder).generate_timed(prompt.numpy(), 8)[2].shape == (1, 8)
    generation, served = GenaiModel(folder).start(prompt[0].tolist(), max_length=12), []
    while not generation.done:
        served.append(generation.step())
    assert served == expected[0, :4].tolist()


def test_a_logging_handler_the_builder_adds_does_not_outlive_its_closed_log(tmp_path):
    """onnxruntime's MatMulNBits quantizer calls logging.basicConfig on import, inside the builder's
    redirected output: every later log line of the process failed on the closed log file."""
    import logging

    from pruneops.runtimes.genai.builder_main import _output_to, _root_logging_kept

    root = logging.getLogger()
    before, level = list(root.handlers), root.level
    with _root_logging_kept(), (tmp_path / "builder.log").open("w") as log, _output_to(log):
        root.addHandler(logging.StreamHandler())  # what basicConfig adds: bound to the redirected stderr
        root.setLevel(logging.INFO)
        logging.getLogger("builder").info("inside")
    assert root.handlers == before and root.level == level
    assert "inside" in (tmp_path / "builder.log").read_text()
