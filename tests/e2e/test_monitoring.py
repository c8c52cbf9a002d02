"""Real Prometheus + Alertmanager + serving app + receiver + a Prefect test server, on loopback.

Shifted inputs raise the drift gauge, the alert fires, the receiver starts one re-prune flow run,
within 60 s; then every Grafana panel's PromQL is run against the live Prometheus.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import threading
import time

import numpy as np
import pytest
import yaml

from tests.conftest import ROOT, free_port, post_json, start_serving, wait_http
from tests.monitoring.helpers import panels_without_data, prom_query

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.skipif(
        not (shutil.which("prometheus") and shutil.which("prometheus-alertmanager")),
        reason="Debian's prometheus and prometheus-alertmanager are not installed (make monitoring-deps)",
    ),
]
pytest.importorskip("prefect", reason="prefect is not installed")
TOKEN = "e2e-token"


def start_monitoring(work, ports) -> list[subprocess.Popen]:
    """Alertmanager routed to the receiver and Prometheus scraping the serving app, test intervals."""
    procs = []
    (work / "token").write_text(TOKEN)
    am = yaml.safe_load((ROOT / "monitoring/alertmanager.yml").read_text())
    am["route"].update(group_wait="1s", group_interval="1s")
    hook = am["receivers"][1]["webhook_configs"][0]
    hook["url"] = f"http://127.0.0.1:{ports['receiver']}/alerts"
    hook["http_config"]["authorization"]["credentials_file"] = str(work / "token")
    (work / "alertmanager.yml").write_text(yaml.safe_dump(am))
    procs.append(
        subprocess.Popen(
            [
                "prometheus-alertmanager",
                f"--config.file={work / 'alertmanager.yml'}",
                f"--storage.path={work / 'am'}",
                f"--web.listen-address=127.0.0.1:{ports['alertmanager']}",
                "--cluster.listen-address=",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    rules = yaml.safe_load((ROOT / "monitoring/rules/alerts.yml").read_text())
    for rule in rules["groups"][0]["rules"]:
        rule["for"] = "0s"  # test intervals; production waits minutes
    (work / "alerts.yml").write_text(yaml.safe_dump(rules))
    shutil.copy(ROOT / "monitoring/rules/recording.yml", work / "recording.yml")
    prom = yaml.safe_load((ROOT / "monitoring/prometheus.yml").read_text())
    prom["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
    prom["rule_files"] = [str(work / "recording.yml"), str(work / "alerts.yml")]
    prom["alerting"]["alertmanagers"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{ports['alertmanager']}"]
    prom["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{ports['serving']}"]
    prom["scrape_configs"] = prom["scrape_configs"][:1]  # the classifier app only
    (work / "prometheus.yml").write_text(yaml.safe_dump(prom))
    procs.append(
        subprocess.Popen(
            [
                "prometheus",
                f"--config.file={work / 'prometheus.yml'}",
                f"--storage.tsdb.path={work / 'tsdb'}",
                f"--web.listen-address=127.0.0.1:{ports['prometheus']}",
                "--rules.alert.resend-delay=1s",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
    )
    return procs


def stop(procs: list[subprocess.Popen]) -> None:
    """Terminates the servers, by PID."""
    for proc in procs:
        proc.terminate()
    for proc in procs:
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()


@pytest.mark.slow
def test_drift_alert_reaches_receiver_and_starts_one_reprune(served_project, tmp_path_factory):
    import uvicorn
    from prefect.client.orchestration import get_client
    from prefect.testing.utilities import prefect_test_harness

    import flows.receiver as receiver_flows
    from flows.reprune import reprune
    from pruneops.serving.receiver import create_receiver

    project, test = served_project
    work = tmp_path_factory.mktemp("monitoring")
    ports = {name: free_port() for name in ("serving", "receiver", "prometheus", "alertmanager")}
    procs: list[subprocess.Popen] = []
    home = tmp_path_factory.mktemp("prefect")
    os.environ.update({"PREFECT_HOME": str(home), "PREFECT_SERVER_ANALYTICS_ENABLED": "false", "DO_NOT_TRACK": "1"})
    with prefect_test_harness(server_startup_timeout=120):
        deployment_id = reprune.to_deployment(name="reprune", parameters={"project_dir": str(project)}).apply()
        app = create_receiver(TOKEN, receiver_flows.run_reprune_deployment)
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=ports["receiver"], log_level="warning"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        try:
            procs.append(start_serving(project, ports["serving"]))
            procs += start_monitoring(work, ports)
            serving = f"http://127.0.0.1:{ports['serving']}"
            prometheus = f"http://127.0.0.1:{ports['prometheus']}"
            for url in (
                f"{serving}/readyz",
                f"{prometheus}/-/ready",
                f"http://127.0.0.1:{ports['alertmanager']}/-/ready",
            ):
                wait_http(url)

            # Normal traffic with feedback, then shifted inputs; bounded loops.
            for i in range(0, 60, 20):  # under the 100 labels the accuracy alert waits for
                out = post_json(f"{serving}/predict", {"inputs": test.x[i : i + 20].tolist()})
                for pid, label in zip(out["prediction_ids"], test.y[i : i + 20], strict=True):
                    post_json(f"{serving}/feedback", {"prediction_id": pid, "label": int(label)})
            time.sleep(2)
            started = time.time()
            shifted = np.clip(test.x[:200] * 0.3 + 0.6, 0, 1)
            for i in range(0, 1200, 100):
                post_json(f"{serving}/predict", {"inputs": shifted[i % 200 : i % 200 + 100].tolist()})
            triggered = []
            while time.time() - started < 60 and not triggered:
                triggered = [d for d in app.state.decisions if d["action"] == "triggered"]
                time.sleep(0.5)
            elapsed = time.time() - started
            assert triggered, f"no re-prune triggered within 60 s; decisions: {app.state.decisions}"
            assert triggered[0]["alertname"] == "PruneOpsDataDrift"
            drift = prom_query(prometheus, 'pruneops_drift_score{group="overall"}')
            assert float(drift[0]["value"][1]) > 0.2
            time.sleep(3)  # Alertmanager repeats: still one run

            async def runs():
                async with get_client() as client:
                    return await client.read_flow_runs()

            import asyncio

            flow_runs = [r for r in asyncio.run(runs()) if r.deployment_id == deployment_id]
            assert len(flow_runs) == 1, [d["action"] for d in app.state.decisions]
            print(f"drift alert -> one re-prune flow run in {elapsed:.1f} s")

            # Every Grafana panel's queries return data from the live Prometheus.
            time.sleep(2)
            empty = panels_without_data(prometheus, "pruneops.json")
            assert not empty, f"panels without data: {empty}"
        finally:
            server.should_exit = True
            stop(procs)
            thread.join(timeout=10)
