"""A bounded load test against the serving app on loopback, and the cost of tracking."""

from __future__ import annotations

import json
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import numpy as np


@dataclass
class LoadResult:
    """What a load run saw."""

    latencies_ms: list[float] = field(default_factory=list)
    statuses: Counter = field(default_factory=Counter)
    versions: Counter = field(default_factory=Counter)
    failures: list[str] = field(default_factory=list)
    wall_s: float = 0.0
    last_version: str | None = None  # the version that answered the last successful request

    @property
    def errors(self) -> int:
        """Requests that did not return 200 (including connection failures)."""
        return sum(n for s, n in self.statuses.items() if s != 200)

    def summary(self) -> dict:
        """p50/p99 latency, throughput, status and model-version counts."""
        lat = np.asarray(self.latencies_ms)
        return {
            "requests": int(sum(self.statuses.values())),
            "errors": self.errors,
            "p50_ms": float(np.percentile(lat, 50)) if len(lat) else None,
            "p99_ms": float(np.percentile(lat, 99)) if len(lat) else None,
            "throughput_rps": float(len(lat) / self.wall_s) if self.wall_s else None,
            "statuses": {str(k): v for k, v in self.statuses.items()},
            "versions": dict(self.versions),
            "last_version": self.last_version,
        }


def run_load(
    url: str,
    inputs: np.ndarray,
    total: int,
    concurrency: int,
    timeout_s: float = 10.0,
    on_response: Callable[[str], None] | None = None,
) -> LoadResult:
    """Sends `total` single-sample /predict requests from `concurrency` threads (keep-alive).

    The loop is bounded by `total`; each request by `timeout_s`. `on_response` is called with
    the model version of each successful answer (e.g. to act once a promotion is served).
    """
    import httpx

    result = LoadResult()
    lock = threading.Lock()
    counter = iter(range(total))
    bodies = [json.dumps({"inputs": x.tolist()}).encode() for x in inputs]

    def worker() -> None:
        with httpx.Client(base_url=url, timeout=timeout_s, headers={"content-type": "application/json"}) as client:
            while True:
                with lock:
                    i = next(counter, None)
                if i is None:
                    return
                started = time.perf_counter()
                try:
                    r = client.post("/predict", content=bodies[i % len(bodies)])
                    status, version = r.status_code, r.json().get("model_version") if r.status_code == 200 else None
                except httpx.HTTPError as exc:
                    status, version = 0, None
                    with lock:
                        result.failures.append(f"{type(exc).__name__}: {exc}")
                elapsed = (time.perf_counter() - started) * 1e3
                with lock:
                    result.statuses[status] += 1
                    if status == 200:
                        result.latencies_ms.append(elapsed)
                        result.versions[version] += 1
                        result.last_version = version
                if status == 200 and on_response is not None:
                    on_response(version)

    started = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        for _ in range(concurrency):
            pool.submit(worker)
    result.wall_s = time.perf_counter() - started
    return result


def tracking_overhead_us(reference: dict, x: np.ndarray, repeats: int = 5000) -> dict:
    """Microseconds per single-sample request spent on metrics and drift tracking (in process).

    Times exactly what /predict adds besides inference: the latency histogram and request counter
    updates and the drift window update; and, separately, one drift scoring as /metrics does it.
    """
    from pruneops.data.drift import DriftMonitor
    from pruneops.serving.app import Metrics

    metrics, monitor = Metrics(), DriftMonitor(reference, window=1000)
    one, cls = x[:1], np.zeros(1, dtype=int)
    started = time.perf_counter()
    for _ in range(repeats):
        metrics.latency.labels("v").observe(0.0001)
        metrics.requests.labels("predict", "200").inc()
        monitor.observe(one, cls)
    per_request = (time.perf_counter() - started) / repeats * 1e6
    started = time.perf_counter()
    monitor.scores()
    scrape = (time.perf_counter() - started) * 1e3
    return {"per_request_us": per_request, "drift_scoring_per_scrape_ms": scrape}
