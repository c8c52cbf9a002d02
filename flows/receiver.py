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


def main() -> None:
    """Entry point: `python -m flows.receiver [--port 8010]` (binds 127.0.0.1)."""
    import uvicorn

    parser = argparse.ArgumentParser(description="PruneOps Alertmanager receiver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args()
    app = create_receiver(os.environ.get("PRUNEOPS_RECEIVER_TOKEN", ""), emit_drift_event)
    uvicorn.run(app, host=args.host, port=args.port)


if __name__ == "__main__":
    main()
