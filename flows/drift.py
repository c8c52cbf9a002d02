"""`drift_check`: read the drift signal and announce drift as a Prefect event (re-prune trigger)."""

from __future__ import annotations

import json
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.events import emit_event

from pruneops.pipeline.stages import load_section

DRIFT_EVENT = "pruneops.drift.detected"
DRIFT_RESOURCE = {"prefect.resource.id": "pruneops.drift"}
# A classifier's overall drift score, or a decoder's prompt token-frequency PSI.
DRIFT_QUERY = "max(pruneops_drift_score) or max(pruneops_prompt_drift_psi)"


@task(retries=2, retry_delay_seconds=5)
def read_drift_score(source: str) -> float | None:
    """Overall drift score from Prometheus' HTTP API, or from a drift report JSON (`overall`)."""
    if source.startswith(("http://", "https://")):
        url = f"{source.rstrip('/')}/api/v1/query?{urllib.parse.urlencode({'query': DRIFT_QUERY})}"
        with urllib.request.urlopen(url, timeout=10) as response:
            result = json.load(response)["data"]["result"]
        return float(result[0]["value"][1]) if result else None
    path = Path(source)
    return float(json.loads(path.read_text())["overall"]) if path.exists() else None


@flow(name="drift-check")
def drift_check(project_dir: str = ".", periodic: bool = False) -> dict[str, Any]:
    """Emits `pruneops.drift.detected` when drift exceeds `reprune.drift_threshold`.

    Args:
        project_dir: The PruneOps project (its params.yaml has the threshold and the source).
        periodic: Emit regardless of the score (a plain scheduled re-prune).
    """
    logger = get_run_logger()
    cfg = load_section(project_dir, "reprune")
    score = read_drift_score(cfg.drift_source)
    crossed = score is not None and score > cfg.drift_threshold
    logger.info("drift score %s (threshold %s)%s", score, cfg.drift_threshold, " -> re-prune" if crossed else "")
    if crossed or periodic:
        emit_event(DRIFT_EVENT, resource=DRIFT_RESOURCE, payload={"score": score, "periodic": periodic})
    return {"score": score, "threshold": cfg.drift_threshold, "triggered": crossed or periodic}
