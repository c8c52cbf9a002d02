"""Clients that leave, over real HTTP: their generations stop, the next request is not held behind them."""

from __future__ import annotations

import threading
import time

import pytest

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
pytest.importorskip("fastapi")
httpx = pytest.importorskip("httpx")

from pruneops.serving.generate import DecoderService, ServeLimits, create_decoder_app  # noqa: E402
from tests.conftest import free_port, wait_http  # noqa: E402

STEP_S = 0.005


class _Generation:
    def __init__(self, length: int):
        self.left, self.done = length, False

    def step(self) -> int:
        time.sleep(STEP_S)
        self.left -= 1
        self.done = self.left <= 0
        return 4  # a word of the tiny vocabulary


class _SlowModel:
    """Every step takes STEP_S and no generation ends before its limit (so an unchecked one runs it out)."""

    max_concurrent, context_length, vocab_size = 8, 4096, 43

    def start(self, prompt, max_length, sampling):
        return _Generation(max_length - len(prompt))


@pytest.fixture
def server(tiny_genai_decoder):
    import uvicorn

    service = DecoderService(tiny_genai_decoder[1], None, limits=ServeLimits(max_prompt_tokens=40))
    service.model = _SlowModel()
    service.scheduler.use(service.model)
    port = free_port()
    app = create_decoder_app(service, "tiny")
    uv = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning"))
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    try:
        wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
        yield f"http://127.0.0.1:{port}", service
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def _hang_up_after_first_token(url: str) -> None:
    body = {"model": "tiny", "prompt": "the people", "max_tokens": 2000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as response:
        for line in response.iter_lines():
            if line.startswith("data: "):
                return  # leaves: the connection closes with the stream


def test_twenty_streamed_and_four_plain_clients_that_leave_do_not_delay_the_next_request(server):
    url, service = server
    clients = [threading.Thread(target=_hang_up_after_first_token, args=(url,)) for _ in range(20)]
    for c in clients:
        c.start()
    for c in clients:
        c.join(timeout=60)
    for _ in range(4):  # plain requests whose clients give up waiting
        with pytest.raises(httpx.ReadTimeout):
            httpx.post(url + "/generate", json={"prompt": "the people", "max_new_tokens": 2000}, timeout=0.3)
    start = time.monotonic()
    answer = httpx.post(url + "/v1/completions", json={"model": "tiny", "prompt": "the", "max_tokens": 4}, timeout=30)
    waited = time.monotonic() - start
    assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 4
    # Unchecked, the 24 generations of 2,000 steps of 5 ms would hold the server for 240 s.
    assert waited < 1.0, waited
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and service.scheduler.load() != (0, 0):
        time.sleep(0.05)
    assert service.scheduler.load() == (0, 0)
    metrics = httpx.get(url + "/metrics", timeout=10).text
    cancelled = next(
        line for line in metrics.splitlines() if line.startswith('pruneops_generations_total{reason="cancelled"}')
    )
    assert float(cancelled.rsplit(" ", 1)[1]) == 24
    generated = next(line for line in metrics.splitlines() if line.startswith("pruneops_generated_tokens_total "))
    assert float(generated.rsplit(" ", 1)[1]) < 24 * 200  # each stopped within a few turns of its client leaving


def test_metrics_and_health_answer_while_every_slot_generates(server):
    url, _ = server
    body = {"model": "tiny", "prompt": "the people", "max_tokens": 50}  # 8 slots stepped in turn: 2 s
    busy = [threading.Thread(target=httpx.post, args=(url + "/v1/completions",), kwargs={"json": body, "timeout": 60})
            for _ in range(10)]  # fmt: skip
    for b in busy:
        b.start()
    time.sleep(0.3)
    for path in ("/metrics", "/healthz"):
        start = time.monotonic()
        assert httpx.get(url + path, timeout=10).status_code == 200
        assert time.monotonic() - start < 0.5
    assert httpx.get(url + "/healthz", timeout=10).json()["running"] == 8
    for b in busy:
        b.join(timeout=60)
