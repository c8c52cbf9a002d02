"""The adversarial sweep of the decoder server: bad bodies on every endpoint, hang-ups, load, corrupt versions.

Called by `adversarial_sweep.py` (`make sweep`); each case is recorded there as handled, internal
or silent. On a tiny onnxruntime-genai Llama built here (context 128) and, for the scheduling
cases, the same server with a model whose every step takes 5 ms (hang-ups and load are then
measurable on any machine).
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

NAME = "tiny"
TEMPLATE = "{% for m in messages %}{{ m['role'] }} {{ m['content'] }} {% endfor %}thank you "


def _build(work: Path) -> Path:
    from pruneops.runtimes.genai.generation import build_genai_model
    from tests.decoder_helpers import save_tiny

    root = Path(tempfile.mkdtemp(dir=work, prefix="decoder-"))
    folder = build_genai_model(save_tiny("llama", root / "hf"), root / "export", "fp32", threads=1)
    (folder / "chat_template.jinja").write_text(TEMPLATE)
    return folder


def _client(folder: Path, feedback_file: Path | None = None):
    from fastapi.testclient import TestClient

    from pruneops.serving.generate import DecoderService, ServeLimits, create_decoder_app

    service = DecoderService(folder, None, feedback_file=feedback_file, limits=ServeLimits(max_prompt_tokens=60))
    return TestClient(create_decoder_app(service, NAME), raise_server_exceptions=False), service


def _cases() -> list[tuple[str, str, dict]]:
    """(case, path, request kwargs): each must be answered 4xx with a bounded message."""
    big = "the " * 300_000
    gen, comp, chat, fb = "/generate", "/v1/completions", "/v1/chat/completions", "/feedback"
    ok = {
        gen: {"prompt": "the people"},
        comp: {"model": NAME, "prompt": "the people"},
        chat: {"model": NAME, "messages": [{"role": "user", "content": "the people"}]},
        fb: {"prompt": "the people", "continuation": "of our nation"},
    }
    cases: list[tuple[str, str, dict]] = []
    for path in (gen, comp, chat, fb):
        cases += [
            (f"{path}: invalid JSON", path, {"content": b'{"prompt": "the",', "headers": _json()}),
            (f"{path}: empty body", path, {"content": b"", "headers": _json()}),
            (f"{path}: JSON array", path, {"json": [1, 2]}),
            (f"{path}: JSON null", path, {"content": b"null", "headers": _json()}),
            (f"{path}: text/plain", path, {"content": b"prompt=the", "headers": {"content-type": "text/plain"}}),
            (f"{path}: 1.2 MB body", path, {"json": {**ok[path], "prompt": big}}),
            (f"{path}: 1.2 MB chunked", path, {"content": _chunks(json.dumps({**ok[path], "x": big}).encode())}),
            (
                f"{path}: nested 5,000 deep",
                path,
                {"content": b'{"a": ' + b"[" * 5000 + b"]" * 5000 + b"}", "headers": _json()},
            ),
            (f"{path}: unknown field", path, {"json": {**ok[path], "frobnicate": 1}}),
            (
                f"{path}: NaN in a field",
                path,
                {"content": json.dumps({**ok[path], "seed": "__"}).replace('"__"', "NaN").encode(), "headers": _json()},
            ),
        ]
    text_fields = {gen: "prompt", comp: "prompt", fb: "continuation"}
    for path, field in text_fields.items():
        cases += [
            (f"{path}: {field} empty", path, {"json": {**ok[path], field: ""}}),
            (f"{path}: {field} 100,001 chars", path, {"json": {**ok[path], field: "a" * 100_001}}),
            (f"{path}: {field} a number", path, {"json": {**ok[path], field: 123}}),
            (f"{path}: {field} null", path, {"json": {**ok[path], field: None}}),
            (
                f"{path}: {field} a lone surrogate",
                path,
                {
                    "content": json.dumps({**ok[path], field: "x"}).replace('"x"', '"the \\ud800 people"').encode(),
                    "headers": _json(),
                },
            ),
            (f"{path}: {field} 200 words (over the context)", path, {"json": {**ok[path], field: "the " * 200}}),
        ]
    numbers = {
        gen: [("max_new_tokens", v) for v in (0, -1, 4097, "4", True, 1.5, 10**30)]
        + [("temperature", v) for v in (-1, 0, 11, "1", True, "Infinity")]
        + [("top_p", v) for v in (0, 1.5, "0.9")]
        + [("top_k", v) for v in (-1, "5", 1e9)]
        + [("seed", v) for v in (-1, 2**31, "7", 1.5)]
        + [("do_sample", v) for v in ("yes", 1, None)]
        + [("stream", v) for v in ("true", 0)],
        comp: [("max_tokens", v) for v in (0, 4097, "16", False)]
        + [("temperature", v) for v in (-0.1, 2.5, "0", True)]
        + [("top_p", v) for v in (0, 2, "1")]
        + [("seed", v) for v in (-5, "1", 2**40)]
        + [("n", v) for v in (2, 0, "1")]
        + [("logprobs", v) for v in (1, True)]
        + [("echo", True), ("best_of", 3), ("suffix", "the"), ("presence_penalty", 0.5), ("frequency_penalty", -1)]
        + [("stop", v) for v in (["a", "b", "c", "d", "e"], "", [""], "x" * 300, 5, [1])]
        + [("stream", "yes"), ("stream_options", {"include_usage": "yes"}), ("stream_options", {"other": 1})]
        + [("model", v) for v in ("gpt-4", "", None, 5)]
        + [("prompt", v) for v in ([], ["the", "people"], [1, 2], [[1, 2]], {"a": 1})],
        chat: [
            ("messages", v)
            for v in (
                [],
                "the",
                [{"role": "robot", "content": "the"}],
                [{"role": "user", "content": None}],
                [{"role": "user"}],
                [{"role": "user", "content": [{"type": "image_url", "image_url": "x"}]}],
                [{"role": "user", "content": [{"type": "text", "text": 5}]}],
                [{"role": "user", "content": "the"}] * 1001,
            )
        ]
        + [("tools", [{"type": "function"}]), ("response_format", {"type": "json_object"}), ("logprobs", True)]
        + [("max_completion_tokens", 0), ("max_tokens", 5000), ("temperature", 9)],
    }
    for path, pairs in numbers.items():
        for field, value in pairs:
            cases.append((f"{path}: {field} = {json.dumps(value)[:30]}", path, {"json": {**ok[path], field: value}}))
    cases.append(
        (
            f"{chat}: max_tokens and max_completion_tokens",
            chat,
            {"json": {**ok[chat], "max_tokens": 2, "max_completion_tokens": 2}},
        )
    )
    cases.append((f"{comp}: 60 prompt tokens allowed, 61 sent", comp, {"json": {**ok[comp], "prompt": "the " * 61}}))
    return cases


def _json() -> dict:
    return {"content-type": "application/json"}


def _chunks(body: bytes):
    return (body[i : i + (1 << 16)] for i in range(0, len(body), 1 << 16))


def sweep_decoder(work: Path, record: Callable[[str, str, str, str], None], http_case: Callable) -> None:
    """Every case of the decoder server (see the module docstring); `http_case` posts one and records it."""
    folder = _build(work)
    client, service = _client(folder, work / "decoder-feedback" / "feedback.jsonl")
    with client:
        for case, path, kwargs in _cases():
            http_case(client, "decoder", case, path, kwargs)
        _answers_still(client, record)
        _feedback_cases(client, service, work, record)
    _template_cases(folder, work, record, http_case)
    _scheduling_cases(folder, record)
    _version_cases(folder, work, record)
    _cli_cases(folder, work, record)


def _answers_still(client, record) -> None:
    checks = {
        "generate still answers": client.post("/generate", json={"prompt": "the people", "max_new_tokens": 3}),
        "completion still answers": client.post(
            "/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 3}
        ),
        "chat still answers": client.post(
            "/v1/chat/completions",
            json={"model": NAME, "messages": [{"role": "user", "content": "good film"}], "max_tokens": 3},
        ),
        "models lists the name": client.get("/v1/models"),
    }
    for case, response in checks.items():
        ok = response.status_code == 200 and (case != "models lists the name" or NAME in response.text)
        record("decoder", case, "handled" if ok else "internal", str(response.status_code))
    metrics = client.get("/metrics").text
    counted = sum(
        float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith("pruneops_requests_total{")
    )
    fives = [
        line for line in metrics.splitlines() if line.startswith("pruneops_requests_total{") and 'status="5' in line
    ]
    record(
        "decoder",
        "every response counted, no 5xx among them",
        "handled" if counted > 100 and not fives else "internal",
        f"{counted:.0f} counted; {fives[:2]}",
    )


def _feedback_cases(client, service, work: Path, record) -> None:
    body = {"prompt": "the people", "continuation": "of our nation work"}
    first = client.post("/feedback", json=body).json()
    tokens = first["rolling_tokens"]
    replays = [client.post("/feedback", json=body).json() for _ in range(50)]
    ok = (
        first["counted"]
        and not any(r["counted"] for r in replays)
        and all(r["rolling_tokens"] == tokens for r in replays)
    )
    record("decoder", "feedback replayed 50 times counts once", "handled" if ok else "silent", f"{tokens} tokens")
    service.feedback_file = work / "no-such-dir-file" / "x"  # the parent is made writable below
    (work / "no-such-dir-file").write_text("a file where the feedback folder should be")
    answer = client.post("/feedback", json={"prompt": "good film", "continuation": "thank you"})
    held = answer.status_code == 200 and answer.json()["saved"] is False and len(service.unsaved) == 1
    record(
        "decoder",
        "feedback file unwritable: kept in memory",
        "handled" if held else "internal",
        f"{answer.status_code} {answer.text[:60]}",
    )
    (work / "no-such-dir-file").unlink()
    again = client.post("/feedback", json={"prompt": "bad film", "continuation": "thank you"}).json()
    lines = (
        (work / "no-such-dir-file" / "x").read_text().splitlines()
        if (work / "no-such-dir-file" / "x").is_file()
        else []
    )
    ok = again["saved"] and len(lines) == 2
    record(
        "decoder", "feedback file writable again: nothing lost", "handled" if ok else "silent", f"{len(lines)} lines"
    )


def _template_cases(folder: Path, work: Path, record, http_case) -> None:
    """A chat template that refuses a conversation, and a model without one."""
    for case, template in (
        (
            "chat template raises on a system turn",
            "{% if messages[0]['role'] == 'system' %}"
            "{{ raise_exception('no system turns') }}{% endif %}{{ messages[0]['content'] }}",
        ),
        ("chat template reads a missing key", "{{ messages[0]['nope']['deeper'] }}"),
        ("no chat template", None),
    ):
        copy = Path(tempfile.mkdtemp(dir=work)) / "model"
        shutil.copytree(folder, copy)
        if template is None:
            (copy / "chat_template.jinja").unlink()
        else:
            (copy / "chat_template.jinja").write_text(template)
        client, _ = _client(copy)
        with client:
            body = {"model": NAME, "messages": [{"role": "system", "content": "the"}, {"role": "user", "content": "a"}]}
            http_case(client, "decoder", case, "/v1/chat/completions", {"json": body})


class _Generation:
    def __init__(self, length: int, step_s: float):
        self.left, self.done, self.step_s = length, False, step_s

    def step(self) -> int:
        time.sleep(self.step_s)
        self.left -= 1
        self.done = self.left <= 0
        return 4


class _SlowModel:
    max_concurrent, context_length, vocab_size = 8, 4096, 43

    def start(self, prompt, max_length, sampling):
        return _Generation(max_length - len(prompt), 0.005)


def _served(folder: Path, max_waiting: int = 32):
    import uvicorn

    from pruneops.serving.generate import DecoderService, ServeLimits, create_decoder_app
    from tests.conftest import free_port, wait_http

    service = DecoderService(folder, None, limits=ServeLimits(max_waiting=max_waiting, max_prompt_tokens=60))
    service.model = _SlowModel()
    service.scheduler.use(service.model)
    port = free_port()
    server = uvicorn.Server(
        uvicorn.Config(create_decoder_app(service, NAME), host="127.0.0.1", port=port, log_level="error")
    )
    threading.Thread(target=server.run, daemon=True).start()
    wait_http(f"http://127.0.0.1:{port}/healthz", timeout=30)
    return server, service, f"http://127.0.0.1:{port}"


def _scheduling_cases(folder: Path, record) -> None:
    server, service, url = _served(folder)
    try:
        _hang_ups(url, record)
        _crowd(url, record)
    finally:
        server.should_exit = True


def _hang_up(url: str) -> None:
    import httpx

    body = {"model": NAME, "prompt": "the people", "max_tokens": 4000, "stream": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=30) as r:
        for line in r.iter_lines():
            if line.startswith("data: "):
                return


def _hang_ups(url: str, record) -> None:
    import contextlib

    import httpx

    threads = [threading.Thread(target=_hang_up, args=(url,)) for _ in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for _ in range(4):
        with contextlib.suppress(httpx.ReadTimeout):
            httpx.post(url + "/generate", json={"prompt": "the", "max_new_tokens": 4000}, timeout=0.3)
    start = time.monotonic()
    r = httpx.post(url + "/v1/completions", json={"model": NAME, "prompt": "the", "max_tokens": 4}, timeout=30)
    waited = time.monotonic() - start
    ok = r.status_code == 200 and waited < 1
    record("decoder", "20 streamed + 4 plain clients hang up", "handled" if ok else "internal", f"next: {waited:.2f} s")


def _crowd(url: str, record) -> None:
    import httpx

    statuses: list[int] = []
    metrics_s: list[float] = []

    def busy() -> None:
        body = {"model": NAME, "prompt": "the", "max_tokens": 200}
        try:
            statuses.append(httpx.post(url + "/v1/completions", json=body, timeout=120).status_code)
        except httpx.HTTPError as exc:
            statuses.append(-1)
            print("busy client:", exc)

    crowd = [threading.Thread(target=busy) for _ in range(60)]
    for t in crowd:
        t.start()
    time.sleep(0.5)
    for _ in range(5):
        tick = time.monotonic()
        httpx.get(url + "/metrics", timeout=10)
        metrics_s.append(time.monotonic() - tick)
    for t in crowd:
        t.join(180)
    fine = set(statuses) <= {200, 429} and statuses.count(429) > 0 and max(metrics_s) < 1
    detail = f"statuses {sorted(set(statuses))}, /metrics max {max(metrics_s):.2f} s"
    record(
        "decoder", "60 concurrent clients: /metrics fast, 429 past the queue", "handled" if fine else "internal", detail
    )
    after = httpx.post(url + "/generate", json={"prompt": "the", "max_new_tokens": 10}, timeout=30)
    record(
        "decoder",
        "serves after the crowd",
        "handled" if after.status_code == 200 else "internal",
        str(after.status_code),
    )


def _registry(folder: Path, work: Path, versions: tuple[str, ...]):
    from pruneops.modelstore.store import ModelRegistry

    registry = ModelRegistry(Path(tempfile.mkdtemp(dir=work)) / "models")
    for version in versions:
        registry.register(folder, {"task": "causal_lm"}, version=version)
    return registry


def _flip(path: Path, count: int = 2000) -> None:
    data = bytearray(path.read_bytes())
    for i in range(0, len(data), max(1, len(data) // count)):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))


def _weights(folder: Path) -> Path:
    return max((p for p in folder.iterdir() if p.name.startswith("model.onnx")), key=lambda p: p.stat().st_size)


def _edit_config(path: Path, edit: Callable[[dict], None]) -> None:
    config = json.loads((path / "genai_config.json").read_text())
    edit(config)
    (path / "genai_config.json").write_text(json.dumps(config))


def _version_cases(folder: Path, work: Path, record) -> None:
    """Corrupt, edited and unservable versions at promote, reload and start-up."""
    from pruneops.core.errors import PruneOpsError

    def context_1(p: Path) -> None:
        _edit_config(p, lambda c: c["model"].update(context_length=1))

    def unknown_type(p: Path) -> None:
        _edit_config(p, lambda c: c["model"].update(type="x"))

    def truncated_tokenizer(p: Path) -> None:
        (p / "tokenizer.json").write_text((p / "tokenizer.json").read_text()[:50])

    after_registration: list[tuple[str, Callable[[Path], None]]] = [
        ("2,000 flipped bytes in the weights", lambda p: _flip(_weights(p))),
        ("genai_config context_length 1 (edited)", context_1),
        ("genai_config model.type unknown (edited)", unknown_type),
        ("tokenizer.json truncated", truncated_tokenizer),
        ("chat template added", lambda p: (p / "chat_template.jinja").write_text("{{ messages }}")),
        ("chat template changed", lambda p: (p / "chat_template.jinja").write_text("{{ bos_token }}")),
        ("genai_config deleted", lambda p: (p / "genai_config.json").unlink()),
        ("metadata.json digests removed", lambda p: (p / "metadata.json").write_text('{"task": "causal_lm"}')),
    ]
    for case, damage in after_registration:
        registry = _registry(folder, work, ("v1", "v2"))
        registry.promote("v1")
        damage(registry.get("v2").path)
        intact = lambda r=registry: r.production().version == "v1"  # noqa: E731
        _refused(record, f"promote: {case}", lambda r=registry: r.promote("v2"), intact)
    registered_bad: list[tuple[str, Callable[[dict], None]]] = [
        ("context_length 1", lambda c: c["model"].update(context_length=1)),
        ("context_length 16", lambda c: c["model"].update(context_length=16)),
        ("unknown model.type", lambda c: c["model"].update(type="no-such-family")),
        ("vocab_size 0", lambda c: c["model"].update(vocab_size=0)),
        ("eos_token_id out of range", lambda c: c["model"].update(eos_token_id=10**6)),
    ]
    for case, edit in registered_bad:
        bad = Path(tempfile.mkdtemp(dir=work)) / "bad"
        shutil.copytree(folder, bad)
        _edit_config(bad, edit)
        registry = _registry(folder, work, ("v1",))
        registry.promote("v1")
        try:
            registry.register(bad, {"task": "causal_lm"}, version="v2")
        except PruneOpsError as exc:
            record("decoder", f"register a folder with {case}", "handled", str(exc)[:90])
            continue
        _refused(
            record,
            f"promote a version with {case}",
            lambda r=registry: r.promote("v2"),
            lambda r=registry: r.production().version == "v1",
        )
    _reload_and_restart(folder, work, record)


def _refused(record, case: str, action: Callable[[], object], intact: Callable[[], bool]) -> None:
    from pruneops.core.errors import PruneOpsError

    try:
        action()
        record("decoder", case, "silent", "accepted")
    except PruneOpsError as exc:
        record("decoder", case, "handled" if intact() else "silent", str(exc)[-90:])
    except Exception as exc:  # noqa: BLE001
        record("decoder", case, "internal", f"{type(exc).__name__}: {str(exc)[:80]}")


def _reload_and_restart(folder: Path, work: Path, record) -> None:
    from pruneops.core.errors import ConfigError
    from pruneops.serving.decoder_service import production_service
    from pruneops.serving.generate import follow_production

    registry = _registry(folder, work, ("v1", "v2", "v3"))
    registry.promote("v1")
    registry.promote("v2")
    service = production_service(registry.root)
    registry.promote("v3")
    _flip(_weights(registry.get("v3").path))
    follow_production(service, registry.root, 0.05)
    time.sleep(1.0)
    ok = service.metrics.version == "v2" and service.metrics.reload_errors._value.get() == 1
    record(
        "decoder",
        "hot reload of a version that rotted after promotion",
        "handled" if ok else "silent",
        f"serves {service.metrics.version}",
    )
    restarted = production_service(registry.root)
    ok = restarted.metrics.version == "v2" and restarted.fallback_from == "v3"
    record(
        "decoder",
        "restart with corrupt production: earlier version",
        "handled" if ok else "silent",
        f"serves {restarted.metrics.version}",
    )
    for version in ("v1", "v2"):
        _flip(_weights(registry.get(version).path))
    try:
        production_service(registry.root)
        record("decoder", "restart with every version corrupt", "silent", "served")
    except ConfigError as exc:
        record("decoder", "restart with every version corrupt", "handled", str(exc)[:90])


def _cli_cases(folder: Path, work: Path, record) -> None:
    empty = Path(tempfile.mkdtemp(dir=work))
    half = Path(tempfile.mkdtemp(dir=work)) / "half"
    shutil.copytree(folder, half)
    _flip(_weights(half))
    broken_config = Path(tempfile.mkdtemp(dir=work)) / "config"
    shutil.copytree(folder, broken_config)
    (broken_config / "genai_config.json").write_text("{not json")
    no_tokenizer = Path(tempfile.mkdtemp(dir=work)) / "tok"
    shutil.copytree(folder, no_tokenizer)
    (no_tokenizer / "tokenizer.json").unlink()
    bad_template = Path(tempfile.mkdtemp(dir=work)) / "tmpl"
    shutil.copytree(folder, bad_template)
    (bad_template / "chat_template.jinja").write_text("{% for %}")
    for case, args in (
        ("--model: an empty folder", ["--model", str(empty)]),
        ("--model: a missing folder", ["--model", str(empty / "nope")]),
        ("--model: genai_config not JSON", ["--model", str(broken_config)]),
        ("--model: no tokenizer.json", ["--model", str(no_tokenizer)]),
        ("--model: a chat template that does not compile", ["--model", str(bad_template)]),
        ("--registry: no production", ["--registry", str(empty)]),
        ("--max-prompt-tokens: -5", ["--model", str(folder), "--max-prompt-tokens", "-5"]),
        ("--max-waiting: 0", ["--model", str(folder), "--max-waiting", "0"]),
    ):
        try:
            result = subprocess.run(
                [sys.executable, "-m", "pruneops.cli", "serve-decoder", *args, "--port", "1"],
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            record("decoder", case, "silent", "still running after 120 s")
            continue
        lines = [line for line in result.stderr.splitlines() if line.strip() and " INFO " not in line]
        if "Traceback" in result.stderr or result.returncode < 0:
            record("decoder", case, "internal", (lines or ["no output"])[-1][:100])
        elif result.returncode == 0:
            record("decoder", case, "silent", "started")
        else:
            record("decoder", case, "handled", (lines or [""])[-1][:100])
