"""Decoder serving on a tiny Llama exported by onnxruntime-genai: /generate, /feedback, drift, metrics."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from pruneops.data.drift import prompt_reference  # noqa: E402
from pruneops.runtimes.genai.generation import greedy_tokens  # noqa: E402
from pruneops.serving.generate import DecoderService, create_decoder_app  # noqa: E402
from tests.decoder_helpers import VOCAB, speeches, tiny_tokenizer  # noqa: E402


@pytest.fixture(scope="module")
def folders(tiny_genai_decoder):
    return tiny_genai_decoder


def _service(folders, reference_texts=None):
    tok = tiny_tokenizer()
    reference = None
    if reference_texts:
        reference = prompt_reference([tok(t, add_special_tokens=False)["input_ids"] for t in reference_texts])
    return DecoderService(folders[1], reference, drift_window=2000)


def _metric(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name + " ") or line.startswith(name + "{"):
            return float(line.rsplit(" ", 1)[1])
    return None


def test_greedy_generation_is_the_exported_models_and_is_timed(folders):
    service = _service(folders)
    client = TestClient(create_decoder_app(service))
    prompt = "the people of our nation work"
    response = client.post("/generate", json={"prompt": prompt, "max_new_tokens": 12})
    assert response.status_code == 200, response.text
    body = response.json()
    ids = np.asarray([service.encode(prompt)], dtype=np.int32)
    expected = greedy_tokens(folders[1], ids, 12)[0]
    eos = tiny_tokenizer().eos_token_id
    cut = list(expected).index(eos) + 1 if eos in expected else 12  # greedy stops at end-of-sequence
    assert body["tokens"] == cut and body["finish_reason"] == ("length" if cut == 12 else "eos")
    assert body["text"] == service.decode(expected[:cut].tolist())
    assert body["ttft_ms"] > 0
    metrics = client.get("/metrics").text
    assert _metric(metrics, "pruneops_time_to_first_token_seconds_count") == 1
    assert _metric(metrics, "pruneops_time_per_output_token_seconds_count") == cut - 1
    assert _metric(metrics, "pruneops_generated_tokens_total") == cut
    assert _metric(metrics, 'pruneops_requests_total{endpoint="generate",status="200"}') == 1


def test_seeded_sampling_repeats_and_bad_requests_are_counted_refusals(folders):
    client = TestClient(create_decoder_app(_service(folders)))
    ask = {"prompt": "thank you", "max_new_tokens": 10, "do_sample": True, "temperature": 1.5, "seed": 7}
    first, again = client.post("/generate", json=ask).json(), client.post("/generate", json=ask).json()
    assert first["text"] == again["text"]
    for bad in ({"prompt": ""}, {"prompt": "x", "max_new_tokens": 0}, {"prompt": "x", "temperature": -1}, {"nope": 1}):
        assert client.post("/generate", json=bad).status_code == 422
    assert _metric(client.get("/metrics").text, 'pruneops_requests_total{endpoint="generate",status="422"}') == 4


def test_prompt_drift_is_absent_until_enough_tokens_then_separates_shifted_prompts(folders):
    reference = speeches(80, seed=1)
    in_domain, shifted = _service(folders, reference), _service(folders, reference)
    needed = in_domain.drift.min_tokens
    assert needed == 20 * len(in_domain.drift.expected)
    client_a, client_b = TestClient(create_decoder_app(in_domain)), TestClient(create_decoder_app(shifted))
    for text in speeches(60, seed=2):
        client_a.post("/generate", json={"prompt": text, "max_new_tokens": 1})
    assert len(in_domain.drift.recent) >= needed
    for _ in range(40):  # prompts of two words only: the token mix is nothing like the reference
        client_b.post("/generate", json={"prompt": " ".join(["awful film"] * 20), "max_new_tokens": 1})
    low = _metric(client_a.get("/metrics").text, "pruneops_prompt_drift_psi")
    high = _metric(client_b.get("/metrics").text, "pruneops_prompt_drift_psi")
    assert low is not None and high is not None
    assert low < 0.2 < high, (low, high)  # the PSI alert threshold of the classifier path
    fresh = TestClient(create_decoder_app(_service(folders, reference)))
    fresh.post("/generate", json={"prompt": "the nation", "max_new_tokens": 1})
    assert _metric(fresh.get("/metrics").text, "pruneops_prompt_drift_psi") is None


def test_feedback_perplexity_is_the_continuations_under_the_model(folders):
    from transformers import AutoModelForCausalLM

    service = _service(folders)
    client = TestClient(create_decoder_app(service))
    prompt, continuation = "the people of", "our nation work jobs family"
    body = client.post("/feedback", json={"prompt": prompt, "continuation": continuation}).json()
    p_ids, c_ids = service.encode(prompt), service.encode(continuation)
    ids = torch.tensor([p_ids + c_ids])
    with torch.inference_mode():
        logits = AutoModelForCausalLM.from_pretrained(folders[0]).eval()(input_ids=ids).logits[0]
    nll = torch.nn.functional.cross_entropy(logits[len(p_ids) - 1 : -1], ids[0, len(p_ids) :])
    assert body["perplexity"] == pytest.approx(math.exp(float(nll)), rel=1e-4)
    assert body["rolling_tokens"] == len(c_ids)
    assert _metric(client.get("/metrics").text, "pruneops_feedback_perplexity") == pytest.approx(body["perplexity"])


def test_a_folder_that_is_not_an_exported_model_is_refused(tmp_path):
    from pruneops.core.errors import ConfigError

    with pytest.raises(ConfigError, match="not an onnxruntime-genai model folder"):
        DecoderService(tmp_path, None)


def _registered(folders, root, versions=("v1",)):
    from pruneops.modelstore.store import ModelRegistry

    registry = ModelRegistry(root / "models")
    for version in versions:
        registry.register(folders[1], {"task": "causal_lm", "precision": "fp32"}, version=version)
    return registry


def test_a_decoder_version_registers_promotes_and_states_its_vocabulary_and_tokenizer(folders, tmp_path):
    from pruneops.modelstore.store import RegistryError, check_servable

    registry = _registered(folders, tmp_path, ("v1", "v2"))
    registry.promote("v1")
    served = check_servable(registry.production().path)
    assert served.contract["num_classes"] == VOCAB and served.contract["tokenizer_sha256"]
    (registry.get("v2").path / "tokenizer.json").write_text("{}")  # tokenises otherwise now
    with pytest.raises(RegistryError):
        registry.promote("v2")
    data = next(registry.get("v1").path.glob("model.onnx.data"), None) or registry.get("v1").path / "model.onnx"
    with open(data, "r+b") as handle:  # one flipped byte in the weights
        byte = handle.read(1)
        handle.seek(0)
        handle.write(bytes([byte[0] ^ 1]))
    with pytest.raises(RegistryError, match="v1"):
        check_servable(registry.get("v1").path)


def test_feedback_is_kept_as_corpus_lines_and_the_service_follows_a_promotion(folders, tmp_path):
    import json
    import time

    from pruneops.serving.generate import follow_production

    registry = _registered(folders, tmp_path, ("v1", "v2"))
    registry.promote("v1")
    service = DecoderService(registry.production().path.resolve(), None, feedback_file=tmp_path / "fb.jsonl")
    client = TestClient(create_decoder_app(service))
    assert client.post("/feedback", json={"prompt": "thank you", "continuation": "good people"}).status_code == 200
    assert [json.loads(line) for line in (tmp_path / "fb.jsonl").read_text().splitlines()] == [
        {"text": "thank you good people"}
    ]
    follow_production(service, registry.root, 0.1)
    registry.promote("v2")
    deadline = time.time() + 10
    while time.time() < deadline and client.get("/healthz").json()["version"] != "v2":
        time.sleep(0.1)
    assert client.get("/healthz").json()["version"] == "v2"
    assert client.post("/generate", json={"prompt": "the people", "max_new_tokens": 3}).json()["tokens"] == 3


def _events(body: str) -> list[tuple[str, dict]]:
    import json

    out = []
    for chunk in body.strip().split("\n\n"):
        lines = dict(line.split(": ", 1) for line in chunk.splitlines())
        out.append((lines["event"], json.loads(lines["data"])))
    return out


def test_streamed_tokens_are_the_plain_answers_tokens_and_are_counted(folders):
    service = _service(folders)
    client = TestClient(create_decoder_app(service))
    ask = {"prompt": "the people of our nation work", "max_new_tokens": 12}
    plain = client.post("/generate", json=ask).json()
    response = client.post("/generate", json={**ask, "stream": True})
    assert response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream")
    events = _events(response.text)
    pieces = [data for name, data in events if name == "token"]
    assert [name for name, _ in events] == ["token"] * len(pieces) + ["done"]
    done, ids = events[-1][1], [i for piece in pieces for i in piece["tokens"]]
    assert done["text"] == plain["text"] and done["tokens"] == plain["tokens"] == len(ids)
    assert "".join(piece["text"] for piece in pieces) == plain["text"]
    assert service.decode(ids) == plain["text"]
    assert client.post("/generate", json={"prompt": "", "stream": True}).status_code == 422
    metrics = client.get("/metrics").text
    assert _metric(metrics, "pruneops_generated_tokens_total") == 2 * plain["tokens"]
    assert _metric(metrics, 'pruneops_requests_total{endpoint="generate",status="200"}') == 2
    assert _metric(metrics, 'pruneops_requests_total{endpoint="generate",status="422"}') == 1


def test_streamed_pieces_join_into_the_decoded_text_for_a_byte_level_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    # Byte-level BPE with no merges: one token per byte, so "é" and "€" span two and three tokens.
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    tokenizer = Tokenizer(models.BPE({c: i for i, c in enumerate(sorted(alphabet))}, []))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    text = "Thank you. Café costs 5€ — merci !"
    ids = tokenizer.encode(text).ids
    assert len(ids) > len(text)  # multi-byte characters split across tokens
    pieces = _pieces(ids, tokenizer)
    assert "".join(p["text"] for p in pieces) == text
    assert [i for p in pieces for i in p["tokens"]] == ids
    assert all("\ufffd" not in p["text"] for p in pieces) and len(pieces) < len(ids)


def test_a_skipped_special_token_does_not_eat_the_space_after_it(folders):
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(folders[1] / "tokenizer.json"))  # word-level: spaces come from decoding
    words = tokenizer.encode("the people of our nation", add_special_tokens=False).ids
    pad = tokenizer.token_to_id("<pad>")
    ids = [words[0], pad, words[1], pad, pad, words[2], words[3], pad, words[4]]
    pieces = _pieces(ids, tokenizer)
    assert "".join(p["text"] for p in pieces) == tokenizer.decode(ids, skip_special_tokens=True)
    assert [i for p in pieces for i in p["tokens"]] == ids


def _pieces(ids: list[int], tokenizer) -> list[dict]:
    """The `token` events' data a stream of `ids` is sent as (what /generate streams, piece by piece)."""
    from pruneops.serving.streaming import Detokenizer

    detok = Detokenizer(tokenizer)
    added = (detok.add(i) for i in ids)
    return [{"tokens": piece[0], "text": piece[1]} for piece in added if piece is not None]


def test_a_promoted_version_that_does_not_load_is_refused_once_and_the_served_one_stays(folders, tmp_path):
    import time

    from pruneops.serving.generate import follow_production

    registry = _registered(folders, tmp_path, ("v1", "v2"))
    registry.promote("v1")
    service = DecoderService(registry.production().path.resolve(), None)
    client = TestClient(create_decoder_app(service))
    registry.promote("v2")
    (registry.get("v2").path / "genai_config.json").write_text("{}")  # broken after its checks passed
    follow_production(service, registry.root, 0.05)
    deadline = time.time() + 10
    while time.time() < deadline and _metric(client.get("/metrics").text, "pruneops_model_reload_errors_total") < 1:
        time.sleep(0.05)
    time.sleep(0.5)  # ten more intervals: the refused version is not retried
    metrics = client.get("/metrics").text
    assert _metric(metrics, "pruneops_model_reload_errors_total") == 1
    assert _metric(metrics, 'pruneops_model_info{model_version="v1"}') == 1
    assert _metric(metrics, 'pruneops_model_info{model_version="v2"}') is None
    assert client.get("/healthz").json()["version"] == "v1"
    assert client.post("/generate", json={"prompt": "the people", "max_new_tokens": 3}).json()["tokens"] == 3
