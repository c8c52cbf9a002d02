"""A bounded load test on loopback with a promotion in the middle: no request may fail."""

import shutil
import threading
import time

import pytest

from pruneops.registry.store import ModelRegistry
from pruneops.serving.loadtest import run_load, tracking_overhead_us
from tests.conftest import ROOT, free_port, start_serving, wait_http

pytest.importorskip("httpx", reason="httpx is not installed")


@pytest.mark.slow
def test_load_with_hot_reload_loses_no_request(served_project):
    project, test = served_project
    port = free_port()
    server = start_serving(project, port, "--reload-interval", "0.2")
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        registry = ModelRegistry(project / "models")
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")

        def promote_soon():
            time.sleep(0.8)
            registry.promote(registry.register(registry.get("v1").model_file, {}, version="v2").version)

        promoter = threading.Thread(target=promote_soon)
        promoter.start()
        result = run_load(f"http://127.0.0.1:{port}", test.x, total=2000, concurrency=8)
        promoter.join()
        summary = result.summary()
        assert summary["requests"] == 2000 and summary["errors"] == 0, result.failures[:3]
        assert set(summary["versions"]) == {"v1", "v2"}  # the swap happened during the load
        assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_tracking_overhead_is_measured(served_project):
    from pruneops.io import read_json

    project, test = served_project
    cost = tracking_overhead_us(read_json(project / "artifacts/validate/reference_stats.json"), test.x, repeats=500)
    assert 0 < cost["per_request_us"] < 1000 and cost["drift_scoring_per_scrape_ms"] > 0
