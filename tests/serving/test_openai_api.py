"""The decoder server's OpenAI API, driven by the official `openai` client and by curl against a running server."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytest.importorskip("fastapi")
openai = pytest.importorskip("openai", reason="the official openai client (dev extra) is not installed")

from pruneops.runtimes.genai.generation import greedy_tokens  # noqa: E402
from tests.conftest import free_port, wait_http  # noqa: E402

# The tiny tokenizer is word-level (lower-case words of its vocabulary), so the template writes words only.
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}{% if add_generation_prompt %}" \
    "thank you {% endif %}"  # fmt: skip
NAME = "tiny-llama"


@pytest.fixture(scope="module")
def server(tiny_genai_decoder, tmp_path_factory):
    """`pruneops serve-decoder` on loopback over the tiny export with a chat template; stopped by PID."""
    folder = tmp_path_factory.mktemp("openai") / "model"
    shutil.copytree(tiny_genai_decoder[1], folder)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    port = free_port()
    cmd = [sys.executable, "-m", "pruneops.cli", "serve-decoder", "--model", str(folder), "--port", str(port),
           "--served-model-name", NAME, "--max-prompt-tokens", "40"]  # fmt: skip
    process = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=60)
        yield f"http://127.0.0.1:{port}", folder
    finally:
        process.terminate()
        process.wait(timeout=20)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server[0] + "/v1", api_key="unused", max_retries=0, timeout=30)


def _greedy_text(folder, ids: list[int], new: int) -> list[int]:
    out = greedy_tokens(folder, np.asarray([ids], dtype=np.int32), new)[0].tolist()
    return out[: out.index(1) + 1] if 1 in out else out  # <eos> (id 1) ends it


def _tokenizer(folder):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(str(folder / "tokenizer.json"))


def test_the_official_client_lists_the_model_and_streams_a_completion_equal_to_the_plain_one(server, client):
    url, folder = server
    assert [m.id for m in client.models.list()] == [NAME]
    prompt = "the people of our nation"
    plain = client.completions.create(model=NAME, prompt=prompt, max_tokens=10, temperature=0)
    tok = _tokenizer(folder)
    ids = tok.encode(prompt, add_special_tokens=False).ids
    expected = _greedy_text(folder, ids, 10)  # the exported model's own greedy continuation
    assert plain.choices[0].text == tok.decode(expected, skip_special_tokens=True)
    assert plain.choices[0].finish_reason == ("stop" if len(expected) < 10 else "length")
    assert (plain.usage.prompt_tokens, plain.usage.completion_tokens) == (len(ids), len(expected))
    assert plain.usage.total_tokens == len(ids) + len(expected)
    stream = client.completions.create(
        model=NAME, prompt=prompt, max_tokens=10, temperature=0, stream=True, stream_options={"include_usage": True}
    )
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == plain.choices[0].finish_reason
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens and not chunks[-1].choices


def test_the_official_client_streams_a_chat_completion_through_the_models_chat_template(server, client):
    url, folder = server
    messages = [{"role": "system", "content": "good film"}, {"role": "user", "content": "the people work"}]
    plain = client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0)
    tok = _tokenizer(folder)
    rendered = "system good film user the people work thank you "  # TEMPLATE over the messages
    ids = tok.encode(rendered, add_special_tokens=False).ids
    expected = _greedy_text(folder, ids, 8)
    assert plain.choices[0].message.role == "assistant"
    assert plain.choices[0].message.content == tok.decode(expected, skip_special_tokens=True)
    assert plain.usage.prompt_tokens == len(ids)
    pieces, roles, reasons = [], [], []
    for chunk in client.chat.completions.create(model=NAME, messages=messages, max_tokens=8, temperature=0,
                                                stream=True):  # fmt: skip
        delta = chunk.choices[0].delta
        roles.append(delta.role)
        pieces.append(delta.content or "")
        reasons.append(chunk.choices[0].finish_reason)
    assert roles[0] == "assistant" and "".join(pieces) == plain.choices[0].message.content
    assert reasons[-1] == plain.choices[0].finish_reason and set(reasons[:-1]) == {None}


def test_a_stop_string_ends_the_text_before_it_and_seeded_sampling_repeats(server, client):
    prompt = "the people of our nation"
    whole = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0).choices[0].text
    words = whole.split()
    assert len(words) >= 4, whole  # a random tiny model rarely ends this early; the stop needs a word to stop at
    stop = " " + words[2]
    cut = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=[stop, "zzz"])
    assert cut.choices[0].text == whole[: whole.index(stop)] and cut.choices[0].finish_reason == "stop"
    streamed = client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=0, stop=stop,
                                         stream=True)  # fmt: skip
    assert "".join(c.choices[0].text for c in streamed) == cut.choices[0].text
    drawn = [client.completions.create(model=NAME, prompt=prompt, max_tokens=12, temperature=1.0, seed=7)
             .choices[0].text for _ in range(2)]  # fmt: skip
    assert drawn[0] == drawn[1]


def test_errors_come_in_openais_shape_and_name_the_parameter(server, client):
    with pytest.raises(openai.NotFoundError) as err:
        client.completions.create(model="gpt-4", prompt="the people", max_tokens=2)
    assert err.value.body["code"] == "model_not_found" and err.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as err:  # the server's prompt bound: 40 tokens
        client.completions.create(model=NAME, prompt="the people " * 30, max_tokens=2)
    assert err.value.body["code"] == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as err:  # prompt and answer beyond the context (128)
        client.completions.create(model=NAME, prompt="the people", max_tokens=4000)
    assert err.value.body["code"] == "context_length_exceeded" and "context of 128" in err.value.body["message"]
    for extra in ({"n": 2}, {"logprobs": 3}, {"echo": True}, {"presence_penalty": 0.5}, {"max_tokens": "4"}):
        with pytest.raises(openai.BadRequestError) as err:
            client.completions.create(model=NAME, prompt="the people", **{"max_tokens": 2, **extra})
        assert err.value.body["param"] == next(iter(extra)), extra


def test_curl_as_the_guide_shows_it(server):
    url, _ = server
    body = {"model": NAME, "messages": [{"role": "user", "content": "good film"}], "max_tokens": 4, "stream": True}
    out = subprocess.run(
        ["curl", "-sS", "-N", f"{url}/v1/chat/completions", "-H", "Content-Type: application/json", "-d",
         json.dumps(body)],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout  # fmt: skip
    events = [line.removeprefix("data: ") for line in out.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert {c["object"] for c in chunks} == {"chat.completion.chunk"}
    assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
    bad = subprocess.run(
        ["curl", "-sS", "-w", "\n%{http_code}", f"{url}/v1/completions", "-H", "Content-Type: application/json",
         "-d", f'{{"model": "{NAME}", "prompt": "the", "temperature": NaN}}'],
        capture_output=True, text=True, timeout=30, check=True,
    ).stdout.rsplit("\n", 1)  # fmt: skip
    assert bad[1] == "400" and json.loads(bad[0])["error"]["param"] == "temperature"


def test_metrics_count_every_openai_request_by_status(server, client):
    import urllib.request

    def counted() -> dict[str, float]:
        with urllib.request.urlopen(server[0] + "/metrics", timeout=10) as response:
            text = response.read().decode()
        return {line.split("{")[1].split("}")[0]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                if line.startswith("pruneops_requests_total{")}  # fmt: skip

    before = counted()
    client.chat.completions.create(model=NAME, messages=[{"role": "user", "content": "the"}], max_tokens=2)
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(model=NAME, messages=[{"role": "robot", "content": "the"}], max_tokens=2)
    after = counted()
    for status in ("200", "400"):
        key = f'endpoint="v1/chat/completions",status="{status}"'
        assert after[key] - before.get(key, 0.0) == 1
