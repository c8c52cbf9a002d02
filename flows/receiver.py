"""Run the alert receiver with a Prefect trigger: each new firing alert emits the drift event.

PRUNEOPS_RECEIVER_TOKEN=... PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.receiver
"""

from __future__ import annotations

import argparse
import os

from prefect.events import emit_event

from flows.drift import DRIFT_EVENT, DRIFT_RESOURCE
from pruneops.serving.receiver import create_receiver


def emit_drift_event(alert: dict) -> str:
    """Sends `pruneops.drift.detected` (the re-prune deployment's trigger) for one alert."""
    labels = alert.get("labels", {})
    event = emit_event(
        DRIFT_EVENT,
        resource=DRIFT_RESOURCE,
        payload={"alertname": labels.get("alertname"), "fingerprint": alert.get("fingerprint"), "labels": labels},
    )
    return str(event.id) if event else "not sent"


def run_reprune_deployment(alert: dict, deployment: str = "reprune/reprune") -> str:
    """Creates a run of the re-prune deployment for one alert (no automation needed)."""
    from prefect.deployments import run_deployment

    labels = alert.get("labels", {})
    run = run_deployment(name=deployment, timeout=0, parameters={"reason": f"alert {labels.get('alertname')}"})
    return str(run.id)


def main() -> None:
    """Entry point: `python -m flows.receiver [--port 8010]` (binds 127.0.0.1)."""
    import logging

    import uvicorn

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description="PruneOps Alertmanager receiver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    parser.add_argument(
        "--trigger",
        choices=["event", "run"],
        default="event",
        help="emit pruneops.drift.detected (automation) or call run_deployment directly",
    )
    args = parser.parse_args()
    trigger = emit_drift_event if args.trigger == "event" else run_reprune_deployment
    app = create_receiver(os.environ.get("PRUNEOPS_RECEIVER_TOKEN", ""), trigger)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
