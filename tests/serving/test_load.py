"""A bounded load test on loopback with a promotion in the middle: no request may fail."""

import shutil
import threading
import time

import pytest

from pruneops.modelstore.store import ModelRegistry
from pruneops.serving.loadtest import run_load, tracking_overhead_us
from tests.conftest import ROOT, free_port, start_serving, wait_http

pytest.importorskip("httpx", reason="httpx is not installed")


@pytest.mark.slow
def test_load_with_a_promotion_and_a_rollback_loses_no_request(served_project):
    """5,000 requests at 4 clients (about 20 s here: the acceptance load of the reliability issue)."""
    project, test = served_project
    port = free_port()
    server = start_serving(project, port, "--reload-interval", "0.2")
    try:
        wait_http(f"http://127.0.0.1:{port}/readyz")
        registry = ModelRegistry(project / "models")
        shutil.copy(ROOT / "params.yaml", project / "params.yaml")
        served_v2 = threading.Event()

        def promote_then_roll_back():
            time.sleep(1.0)
            registry.promote(registry.register(registry.get("v1").model_file, {}, version="v2").version)
            served_v2.wait(30)
            time.sleep(1.0)
            registry.rollback("back during the load")

        changer = threading.Thread(target=promote_then_roll_back)
        changer.start()

        def on_response(version: str) -> None:
            if version == "v2":
                served_v2.set()

        result = run_load(f"http://127.0.0.1:{port}", test.x, total=5000, concurrency=4, on_response=on_response)
        changer.join()
        summary = result.summary()
        print(f"load: {summary}")
        assert summary["requests"] == 5000 and summary["errors"] == 0, result.failures[:3]
        assert summary["versions"]["v2"] > 0 and summary["versions"]["v1"] > 0
        assert summary["last_version"] == "v1"  # the rollback was served before the load ended
        assert 0 < summary["p50_ms"] <= summary["p99_ms"]
    finally:
        server.terminate()
        server.wait(timeout=10)


def test_tracking_overhead_is_measured(served_project):
    from pruneops.core.io import read_json

    project, test = served_project
    cost = tracking_overhead_us(read_json(project / "artifacts/validate/reference_stats.json"), test.x, repeats=500)
    assert 0 < cost["per_request_us"] < 1000 and cost["drift_scoring_per_scrape_ms"] > 0
