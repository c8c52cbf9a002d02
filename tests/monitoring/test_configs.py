"""The monitoring configs: promtool rule tests, Alertmanager config, dashboard wiring."""

import json
import shutil
import subprocess

import pytest
import yaml

from tests.conftest import ROOT

MON = ROOT / "monitoring"


@pytest.mark.skipif(not shutil.which("promtool"), reason="promtool (Debian's prometheus) is not installed")
def test_promtool_checks_and_unit_tests_pass():
    check = subprocess.run(
        ["promtool", "check", "rules", *map(str, (MON / "rules").glob("*.yml"))], capture_output=True, text=True
    )
    assert check.returncode == 0, check.stdout + check.stderr
    tests = subprocess.run(
        ["promtool", "test", "rules", "tests/alerts_test.yml"], cwd=MON, capture_output=True, text=True
    )
    assert tests.returncode == 0 and "SUCCESS" in tests.stdout, tests.stdout + tests.stderr


@pytest.mark.skipif(not shutil.which("amtool"), reason="amtool (Debian's prometheus-alertmanager) is not installed")
def test_alertmanager_config_is_valid_and_routes_reprune_alerts():
    result = subprocess.run(["amtool", "check-config", "alertmanager.yml"], cwd=MON, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    config = yaml.safe_load((MON / "alertmanager.yml").read_text())
    route = config["route"]["routes"][0]
    assert route["matchers"] == ['action="reprune"'] and route["receiver"] == "reprune"
    alerts = yaml.safe_load((MON / "rules/alerts.yml").read_text())["groups"][0]["rules"]
    assert {r["alert"] for r in alerts if r["labels"].get("action") == "reprune"} == {
        "PruneOpsDataDrift",
        "PruneOpsPromptDrift",
        "PruneOpsAccuracyDrop",
    }


@pytest.mark.parametrize("name", ["pruneops.json", "pruneops-decoder.json"])
def test_dashboard_panels_use_the_provisioned_datasource(name):
    uid = yaml.safe_load((MON / "grafana/provisioning/datasources/prometheus.yml").read_text())["datasources"][0]["uid"]
    dashboard = json.loads((MON / f"grafana/dashboards/{name}").read_text())
    assert len(dashboard["panels"]) >= 8
    uids = {json.loads(path.read_text())["uid"] for path in (MON / "grafana/dashboards").glob("*.json")}
    assert len(uids) == len(list((MON / "grafana/dashboards").glob("*.json")))  # Grafana keys dashboards by uid
    for panel in dashboard["panels"]:
        assert panel["datasource"]["uid"] == uid
        assert panel["targets"] and all(t["expr"] for t in panel["targets"])
