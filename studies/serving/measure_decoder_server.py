"""The decoder server against the one before it: concurrent clients, a promotion mid-run, clients that hang up.

Both servers run the same model folder on this machine, each over its own registry of two copies
of it (v1, v2), following production. The baseline is `pruneops serve-decoder` from an older
checkout (`--baseline-root`, e.g. a `git worktree` of the commit before the scheduler: one lock,
/generate); the current one is this checkout's (scheduler, batching, the OpenAI API). Rounds are
interleaved (baseline, current, then current, baseline, ...). In each round `--clients` clients
each stream `--requests` greedy completions of `--new-tokens` tokens (the baseline's /generate,
the current server's /v1/completions), and halfway through the other copy is promoted in that
server's registry. Per server: aggregate generated tokens per second (all tokens over the round's
wall time), client-side time to first token and per further token (p50, p99), errors; then 20
clients that hang up after their first token, and how much longer a 4-token request takes after
them than on the idle server.

python studies/serving/measure_decoder_server.py --model FOLDER --baseline-root ../old-checkout
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def _prompts(n: int) -> list[str]:
    words = (ROOT / "assets/llm/hamlet.txt").read_text(encoding="utf-8", errors="replace").split()
    rng = np.random.default_rng(0)
    starts = rng.integers(0, len(words) - 80, n)
    return [" ".join(words[s : s + int(rng.integers(20, 60))]) for s in starts]


def _event(data: dict) -> tuple[str, int]:
    """What one streamed event is: the generated-token count (usage, the baseline's `done`), a text piece, an error."""
    if "usage" in data and not data.get("choices"):
        return "tokens", data["usage"]["completion_tokens"]
    if "tokens" in data and "finish_reason" in data:  # the baseline's `done`
        return "tokens", data["tokens"]
    if data.get("tokens") or (data.get("choices") and data["choices"][0].get("text")):
        return "piece", 0
    if "error" in data or "detail" in data:
        return "error", 0
    return "other", 0


class Server:
    """One `serve-decoder` process over its own registry (v1, v2: copies of the model)."""

    def __init__(self, name: str, root: Path, model: Path, work: Path, port: int):
        from pruneops.modelstore.store import ModelRegistry

        self.name, self.root, self.port = name, root, port
        self.registry = ModelRegistry(work / name / "models")
        for version in ("v1", "v2"):
            self.registry.register(model, {"task": "causal_lm"}, version=version)
        self.registry.promote("v1")
        cmd = [sys.executable, "-m", "pruneops.cli", "serve-decoder", "--registry", str(self.registry.root),
               "--port", str(port), "--reload-interval", "1"]  # fmt: skip
        self.log = (work / f"{name}.log").open("w")
        self.process = subprocess.Popen(cmd, cwd=root, stdout=self.log, stderr=subprocess.STDOUT)
        self.url = f"http://127.0.0.1:{port}"

    def wait(self) -> None:
        from tests.conftest import wait_http

        wait_http(self.url + "/healthz", timeout=180)

    def promote_other(self) -> str:
        version = "v2" if self.registry.production().version == "v1" else "v1"
        self.registry.promote(version)
        return version

    def stream(self, prompt: str, new_tokens: int) -> dict:
        """One streamed greedy completion: ok, client-side first-token and per-token times, tokens."""
        import httpx

        if self.name == "baseline":
            path, body = "/generate", {"prompt": prompt, "max_new_tokens": new_tokens, "stream": True}
        else:
            path = "/v1/completions"
            body = {"model": "models", "prompt": prompt, "max_tokens": new_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}}  # fmt: skip
        start, times, tokens = time.perf_counter(), [], 0
        try:
            with httpx.stream("POST", self.url + path, json=body, timeout=300) as response:
                if response.status_code != 200:
                    return {"ok": False, "status": response.status_code}
                for line in response.iter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    kind, value = _event(json.loads(line[6:]))
                    if kind == "error":
                        return {"ok": False, "status": "error event"}
                    if kind == "tokens":
                        tokens = value
                    elif kind == "piece":
                        times.append(time.perf_counter() - start)
        except httpx.HTTPError as exc:
            return {"ok": False, "status": type(exc).__name__}
        if not times or tokens < 1:
            return {"ok": False, "status": "no tokens"}
        tpot = (times[-1] - times[0]) / (tokens - 1) if tokens > 1 else None
        return {"ok": True, "ttft": times[0], "tpot": tpot, "tokens": tokens}

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)
        self.log.close()


def load_round(server: Server, prompts: list[str], clients: int, requests: int, new_tokens: int) -> dict:
    """`clients` clients streaming `requests` completions each; the other copy promoted halfway."""
    results: list[dict] = []
    lock = threading.Lock()
    half = threading.Event()
    total = clients * requests

    def client(c: int) -> None:
        for r in range(requests):
            answer = server.stream(prompts[(c * requests + r) % len(prompts)], new_tokens)
            with lock:
                results.append(answer)
                if len(results) >= total // 2:
                    half.set()

    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    start = time.perf_counter()
    for t in threads:
        t.start()
    half.wait()
    promoted = server.promote_other()
    for t in threads:
        t.join()
    wall = time.perf_counter() - start
    ok = [r for r in results if r["ok"]]
    ttft = [r["ttft"] for r in ok]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {
        "tokens_per_s": sum(r["tokens"] for r in ok) / wall,
        "wall_s": wall,
        "requests": len(results),
        "errors": len(results) - len(ok),
        "error_kinds": sorted({str(r["status"]) for r in results if not r["ok"]}),
        "ttft_p50_ms": 1e3 * float(np.percentile(ttft, 50)),
        "ttft_p99_ms": 1e3 * float(np.percentile(ttft, 99)),
        "tpot_p50_ms": 1e3 * float(np.percentile(tpot, 50)),
        "tpot_p99_ms": 1e3 * float(np.percentile(tpot, 99)),
        "promoted_mid_run": promoted,
    }


def hang_ups(server: Server, prompts: list[str]) -> dict:
    """How much longer a 4-token request takes after 20 clients hung up after their first token."""
    import httpx

    def four() -> float:
        tick = time.perf_counter()
        answer = server.stream(prompts[0], 4)
        assert answer["ok"], answer
        return time.perf_counter() - tick

    idle = min(four() for _ in range(3))

    def leave(i: int) -> None:
        body = ({"prompt": prompts[i], "max_new_tokens": 128, "stream": True} if server.name == "baseline" else
                {"model": "models", "prompt": prompts[i], "max_tokens": 128, "stream": True})  # fmt: skip
        path = "/generate" if server.name == "baseline" else "/v1/completions"
        with httpx.stream("POST", server.url + path, json=body, timeout=300) as response:
            for line in response.iter_lines():
                if line.startswith("data: ") or line.startswith("event: token"):
                    return

    threads = [threading.Thread(target=leave, args=(i,)) for i in range(20)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    after = four()
    return {"idle_s": idle, "after_s": after, "delay_s": after - idle}


def _machine() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return f"{line.split(':', 1)[1].strip()}, {platform.machine()}"
    except OSError:
        pass
    return platform.processor() or platform.machine()


def main() -> int:
    """Runs the comparison and writes its record (`--out`)."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="an exported decoder folder (genai)")
    parser.add_argument("--baseline-root", required=True, help="a checkout of the server to compare with")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--clients", type=int, default=8)
    parser.add_argument("--requests", type=int, default=3, help="completions per client per round")
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--out", default=str(ROOT / "studies/serving/decoder_server.json"))
    args = parser.parse_args()
    from tests.conftest import free_port

    work = Path(tempfile.mkdtemp(prefix="pruneops-serving-bench-"))
    prompts = _prompts(64)
    servers = {
        "baseline": Server("baseline", Path(args.baseline_root).resolve(), Path(args.model), work, free_port()),
        "current": Server("current", ROOT, Path(args.model), work, free_port()),
    }
    try:
        for server in servers.values():
            server.wait()
        rounds: dict[str, list[dict]] = {name: [] for name in servers}
        for r in range(args.rounds):
            order = ["baseline", "current"] if r % 2 == 0 else ["current", "baseline"]
            for name in order:
                result = load_round(servers[name], prompts, args.clients, args.requests, args.new_tokens)
                rounds[name].append(result)
                print(f"round {r} {name:8}: {result['tokens_per_s']:6.1f} tok/s, TTFT p50 {result['ttft_p50_ms']:.0f} "
                      f"p99 {result['ttft_p99_ms']:.0f} ms, TPOT p50 {result['tpot_p50_ms']:.1f} p99 "
                      f"{result['tpot_p99_ms']:.1f} ms, errors {result['errors']}", flush=True)  # fmt: skip
        left = {name: hang_ups(server, prompts) for name, server in servers.items()}
    finally:
        for server in servers.values():
            server.stop()
    summary = {name: {key: float(np.median([r[key] for r in rows])) for key in
                      ("tokens_per_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms")}
               for name, rows in rounds.items()}  # fmt: skip
    ratio = summary["current"]["tokens_per_s"] / summary["baseline"]["tokens_per_s"]
    record = {
        "command": " ".join(sys.argv),
        "machine": _machine(),
        "date": time.strftime("%Y-%m-%d %H:%M"),
        "model": str(args.model),
        "workload": {"clients": args.clients, "requests_per_client": args.requests, "new_tokens": args.new_tokens,
                     "rounds": args.rounds, "greedy": True, "promotion": "the other copy, halfway through each round"},
        "rounds": rounds,
        "median": summary,
        "aggregate_tokens_per_s_ratio": ratio,
        "errors": {name: sum(r["errors"] for r in rows) for name, rows in rounds.items()},
        "hang_ups": left,
    }  # fmt: skip
    Path(args.out).write_text(json.dumps(record, indent=2) + "\n")
    print(json.dumps({"median": summary, "ratio": ratio, "hang_ups": left, "errors": record["errors"]}, indent=2))
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
