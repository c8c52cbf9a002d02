"""What the tests on a live Prometheus share: a query, and the dashboard panels it has no data for."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request

from tests.conftest import ROOT


def prom_query(base: str, expr: str) -> list:
    """The result vector of an instant query."""
    with urllib.request.urlopen(f"{base}/api/v1/query?{urllib.parse.urlencode({'query': expr})}", timeout=10) as r:
        return json.load(r)["data"]["result"]


def panels_without_data(base: str, dashboard: str) -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query of `monitoring/grafana/dashboards/<dashboard>` that returns nothing."""
    panels = json.loads((ROOT / "monitoring/grafana/dashboards" / dashboard).read_text())["panels"]
    return [(p["title"], t["expr"]) for p in panels for t in p["targets"] if not prom_query(base, t["expr"])]
