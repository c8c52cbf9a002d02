"""Run the alert receiver with a confirmed Prefect trigger: each new firing alert creates a re-prune run.

PRUNEOPS_RECEIVER_TOKEN=... PREFECT_API_URL=http://127.0.0.1:4200/api python -m flows.receiver

The trigger creates a flow run of the `reprune/reprune` deployment through the Prefect API and
returns its id: the API's answer confirms it. (A Prefect event would be fire-and-forget: with the
API down it is lost while the receiver reports success.)
"""

from __future__ import annotations

import argparse
import os
import sys


def api_url() -> str:
    """The Prefect API the receiver starts runs on: `PREFECT_API_URL`, from the environment or the profile."""
    from prefect.settings import PREFECT_API_URL

    return os.environ.get("PREFECT_API_URL") or (PREFECT_API_URL.value() or "")


def run_reprune_deployment(alert: dict, deployment: str = "reprune/reprune") -> str:
    """Creates a run of the re-prune deployment for one alert; raises unless the API confirms it."""
    from prefect.deployments import run_deployment

    labels = alert.get("labels", {})
    run = run_deployment(name=deployment, timeout=0, parameters={"reason": f"alert {labels.get('alertname')}"})
    return str(run.id)


def main() -> None:
    """Entry point: `python -m flows.receiver [--port 8010]` (binds 127.0.0.1)."""
    import logging

    from pruneops.serving.limits import run_server
    from pruneops.serving.receiver import create_receiver

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    parser = argparse.ArgumentParser(description="PruneOps Alertmanager receiver")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8010)
    args = parser.parse_args()
    token = os.environ.get("PRUNEOPS_RECEIVER_TOKEN", "")
    needed = (("PRUNEOPS_RECEIVER_TOKEN", token), ("PREFECT_API_URL", api_url()))
    missing = [name for name, value in needed if not value]
    if missing:
        # Without an API URL Prefect would start a private ephemeral server, without auth, that
        # outlives the receiver and that no worker watches.
        print(
            f"flows.receiver: error: set {' and '.join(missing)} (re-prunes start on that Prefect API)", file=sys.stderr
        )
        sys.exit(2)
    app = create_receiver(token, run_reprune_deployment)
    run_server(app, args.host, args.port, read_timeout_s=10.0)


if __name__ == "__main__":
    main()
