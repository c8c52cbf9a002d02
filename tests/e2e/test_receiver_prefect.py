"""The receiver against a real Prefect server that goes away: 5xx, then exactly one re-prune on the retry."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from tests.conftest import free_port, wait_http

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
pytest.importorskip("prefect", reason="prefect is not installed")
AUTH = "pruneops:e2e-secret"


def start_server(home: Path, port: int) -> subprocess.Popen:
    """`prefect server start` on loopback with API auth; stopped by PID."""
    env = {
        **os.environ,
        "PREFECT_HOME": str(home),
        "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
        "PREFECT_SERVER_API_AUTH_STRING": AUTH,
        "PREFECT_UI_ENABLED": "false",
    }
    prefect = str(Path(sys.executable).parent / "prefect")
    proc = subprocess.Popen(
        [prefect, "server", "start", "--host", "127.0.0.1", "--port", str(port)],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    wait_http(f"http://127.0.0.1:{port}/api/health", timeout=120)
    return proc


def stop(proc: subprocess.Popen) -> None:
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()


def test_a_trigger_is_acknowledged_only_when_confirmed_and_the_retry_triggers_once(tmp_path):
    import asyncio

    from fastapi.testclient import TestClient
    from prefect.client.orchestration import get_client
    from prefect.settings import (
        PREFECT_API_AUTH_STRING,
        PREFECT_API_URL,
        PREFECT_CLIENT_MAX_RETRIES,
        temporary_settings,
    )

    from flows.receiver import run_reprune_deployment
    from flows.reprune import reprune
    from pruneops.serving.receiver import create_receiver

    port = free_port()
    home = tmp_path / "prefect"
    server = start_server(home, port)
    settings = {
        PREFECT_API_URL: f"http://127.0.0.1:{port}/api",
        PREFECT_API_AUTH_STRING: AUTH,
        PREFECT_CLIENT_MAX_RETRIES: 1,
    }
    alert = {"alerts": [{"status": "firing", "fingerprint": "drift-1", "labels": {"alertname": "PruneOpsDataDrift"}}]}
    auth = {"Authorization": "Bearer t"}
    try:
        with temporary_settings(updates=settings):
            deployment_id = reprune.to_deployment(name="reprune", parameters={"project_dir": str(tmp_path)}).apply()
            client = TestClient(create_receiver("t", run_reprune_deployment, cooldown_s=600))
            stop(server)  # the Prefect API goes away
            refused = client.post("/alerts", json=alert, headers=auth)
            assert refused.status_code == 503 and "not confirmed" in refused.json()["detail"]
            server = start_server(home, port)  # back, with the same database
            retried = client.post("/alerts", json=alert, headers=auth)  # Alertmanager's retry
            assert retried.status_code == 200 and retried.json()["triggered"] == 1
            again = client.post("/alerts", json=alert, headers=auth)  # and its repeat of a firing alert
            assert again.json()["duplicates"] == 1

            async def runs():
                async with get_client() as prefect:
                    return [r for r in await prefect.read_flow_runs() if r.deployment_id == deployment_id]

            time.sleep(1)
            assert len(asyncio.run(runs())) == 1
            actions = [d["action"] for d in client.get("/decisions", headers=auth).json()]
            assert actions == ["trigger failed", "triggered", "duplicate"]
    finally:
        stop(server)
