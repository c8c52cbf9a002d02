"""Batched decoding of a genai folder: each row's greedy continuation is the one it has alone, whoever joins."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

from pruneops.runtimes.genai import GenaiModel  # noqa: E402
from pruneops.runtimes.genai.batch import BatchDecoder  # noqa: E402


def _alone(model: GenaiModel, prompt: list[int], new: int) -> list[int]:
    generation = model.start(prompt, len(prompt) + new)
    tokens = [generation.step()]
    while not generation.done:
        tokens.append(generation.step())
    return tokens


def test_rows_of_different_lengths_joining_and_leaving_decode_as_they_do_alone(tiny_genai_decoder):
    folder = tiny_genai_decoder[1]
    decoder, alone = GenaiModel(folder).serving(), GenaiModel(folder).load()
    assert isinstance(decoder, BatchDecoder)
    rng = np.random.default_rng(3)
    prompts = [rng.integers(3, 40, int(n)).tolist() for n in (2, 9, 5, 17, 3, 12)]
    news = [12, 5, 20, 8, 15, 10]
    generations = [decoder.start(p, len(p) + n) for p, n in zip(prompts, news, strict=True)]
    out: dict[int, list[int]] = {id(g): [] for g in generations}
    waiting, running, turns, widest = list(generations), [], 0, 0
    while waiting or running:
        if waiting and turns % 2 == 0:  # they join every other step (three at once first), while others end
            for _ in range(3 if turns == 0 else 1):
                running.append(waiting.pop(0))
        for generation, token in zip(running, decoder.step_batch(running), strict=True):
            if token is not None:  # None: read in a later step (one prompt per step)
                out[id(generation)].append(token)
        widest = max(widest, len(running))
        running = [g for g in running if not g.done]
        turns += 1
    for generation, prompt, new in zip(generations, prompts, news, strict=True):
        assert out[id(generation)] == _alone(alone, prompt, new)  # genai's own generator, alone
    assert widest >= 3  # several rows were decoded together


def test_seeded_sampling_repeats_and_the_decoder_scores_as_the_model_does(tiny_genai_decoder):
    folder = tiny_genai_decoder[1]
    decoder, model = GenaiModel(folder).serving(), GenaiModel(folder)
    sampling = {"temperature": 1.0, "top_k": 0, "top_p": 0.9, "seed": 11}
    draws = []
    for _ in range(2):
        generation = decoder.start([4, 5, 6], 20, sampling)
        tokens = [generation.step()]
        while not generation.done:
            tokens.append(generation.step())
        draws.append(tokens)
    assert draws[0] == draws[1]
    ids = np.asarray([4, 5, 6, 7, 8, 9])
    np.testing.assert_allclose(decoder.token_losses(ids), model.token_losses(ids), rtol=1e-6)
