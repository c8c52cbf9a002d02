import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from pruneops.serving.receiver import create_receiver  # noqa: E402


def _alert(fp, status="firing", name="PruneOpsDataDrift"):
    return {"status": status, "fingerprint": fp, "labels": {"alertname": name, "action": "reprune"}}


def test_token_dedupe_and_resolved():
    runs = []
    app = create_receiver("s3cret", lambda alert: runs.append(alert["fingerprint"]) or f"run-{len(runs)}", cooldown_s=0)
    client = TestClient(app)
    body = {"status": "firing", "alerts": [_alert("a")]}
    assert client.post("/alerts", json=body).status_code == 401
    assert client.post("/alerts", json=body, headers={"Authorization": "Bearer nope"}).status_code == 401
    auth = {"Authorization": "Bearer s3cret"}
    assert client.post("/alerts", json=body, headers=auth).json() == {
        "triggered": 1,
        "ignored_resolved": 0,
        "duplicates": 0,
        "cooldown": 0,
    }
    # Alertmanager repeats a firing alert: still one re-prune.
    assert client.post("/alerts", json=body, headers=auth).json()["duplicates"] == 1
    two = {"status": "firing", "alerts": [_alert("a"), _alert("b", name="PruneOpsAccuracyDrop")]}
    assert client.post("/alerts", json=two, headers=auth).json() == {
        "triggered": 1,
        "ignored_resolved": 0,
        "duplicates": 1,
        "cooldown": 0,
    }
    resolved = {"status": "resolved", "alerts": [_alert("a", status="resolved")]}
    assert client.post("/alerts", json=resolved, headers=auth).json()["ignored_resolved"] == 1
    assert client.post("/alerts", json=body, headers=auth).json()["triggered"] == 1  # fires again later
    assert runs == ["a", "b", "a"]
    actions = [d["action"] for d in client.get("/decisions", headers=auth).json()]
    assert client.get("/decisions").status_code == 401  # the decision log is behind the token too
    assert actions == ["triggered", "duplicate", "duplicate", "triggered", "ignored", "triggered"]
    assert client.post("/alerts", content=b"{}", headers=auth).status_code == 422


def test_empty_token_refuses_everything():
    client = TestClient(create_receiver("", lambda alert: "x"))
    assert client.post("/alerts", json={"alerts": []}, headers={"Authorization": "Bearer "}).status_code == 401


def test_cooldown_gives_one_reprune_per_burst_and_failed_triggers_are_retried():
    calls = []

    def flaky(alert):
        calls.append(alert["fingerprint"])
        if len(calls) == 1:
            raise RuntimeError("prefect unreachable")
        return "run"

    client = TestClient(create_receiver("t", flaky, cooldown_s=600), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer t"}
    body = {"alerts": [_alert("drift")]}
    assert client.post("/alerts", json=body, headers=auth).status_code == 503  # not confirmed: Alertmanager retries
    assert client.post("/alerts", json=body, headers=auth).json()["triggered"] == 1
    burst = {"alerts": [_alert("accuracy", name="PruneOpsAccuracyDrop")]}
    assert client.post("/alerts", json=burst, headers=auth).json()["cooldown"] == 1
    assert calls == ["drift", "drift"]


def test_an_alert_answered_cooldown_triggers_on_its_repeat_after_the_cooldown():
    runs = []
    client = TestClient(create_receiver("t", lambda a: runs.append(a["fingerprint"]) or "run", cooldown_s=0.3))
    auth = {"Authorization": "Bearer t"}
    assert client.post("/alerts", json={"alerts": [_alert("drift")]}, headers=auth).json()["triggered"] == 1
    late = {"alerts": [_alert("accuracy", name="PruneOpsAccuracyDrop")]}
    assert client.post("/alerts", json=late, headers=auth).json()["cooldown"] == 1
    time.sleep(0.4)
    assert client.post("/alerts", json=late, headers=auth).json()["triggered"] == 1  # Alertmanager's repeat
    assert runs == ["drift", "accuracy"]


def test_an_alert_arriving_while_a_trigger_is_in_flight_is_answered_503_and_triggers_on_retry():
    started, release, runs = threading.Event(), threading.Event(), []

    def slow_then_failing(alert):
        runs.append(alert["fingerprint"])
        if len(runs) == 1:
            started.set()
            release.wait(5)
            raise ConnectionError("Prefect API went away")
        return "run"

    client = TestClient(create_receiver("t", slow_then_failing, cooldown_s=600), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer t"}
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/alerts", json={"alerts": [_alert("drift")]}, headers=auth)
        assert started.wait(5)
        during = client.post("/alerts", json={"alerts": [_alert("accuracy")]}, headers=auth)
        release.set()
        assert first.result().status_code == 503  # the in-flight trigger failed: retried by Alertmanager
    assert during.status_code == 503 and "in flight" in during.json()["detail"]
    retry = client.post("/alerts", json={"alerts": [_alert("accuracy")]}, headers=auth)
    assert retry.json()["triggered"] == 1  # not lost with the failed trigger
    assert runs == ["drift", "accuracy"]


def test_the_receiver_refuses_to_start_without_an_explicit_prefect_api(tmp_path):
    pytest.importorskip("prefect", reason="prefect is not installed")
    env = {k: v for k, v in os.environ.items() if k != "PREFECT_API_URL"}
    env.update(PRUNEOPS_RECEIVER_TOKEN="t", PREFECT_HOME=str(tmp_path), PREFECT_PROFILES_PATH=str(tmp_path / "p.toml"))
    done = subprocess.run(
        [sys.executable, "-m", "flows.receiver", "--port", "0"],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        cwd=Path(__file__).resolve().parents[2],
    )
    assert done.returncode == 2
    assert done.stderr.strip().splitlines() == [
        "flows.receiver: error: set PREFECT_API_URL (re-prunes start on that Prefect API)"
    ]
