"""Serve the deployments: pipeline (on demand), drift check (cron), re-prune (on the drift event).

make prefect-server   # local Prefect server on 127.0.0.1:4200 (SQLite under state/)
make deploy           # this module: serves the three deployments until interrupted
"""

from __future__ import annotations

import argparse
from pathlib import Path

from prefect import serve
from prefect.client.schemas.objects import ConcurrencyLimitConfig, ConcurrencyLimitStrategy
from prefect.events.schemas.deployment_triggers import DeploymentEventTrigger

from flows.drift import DRIFT_EVENT, DRIFT_RESOURCE, drift_check
from flows.pipeline import pruning_pipeline
from flows.reprune import reprune
from pruneops.pipeline.stages import load_section

# One re-prune at a time; a trigger arriving while one runs is cancelled, not queued.
ONE_AT_A_TIME = ConcurrencyLimitConfig(limit=1, collision_strategy=ConcurrencyLimitStrategy.CANCEL_NEW)


def build_deployments(project_dir: str) -> list:
    """The three deployments of a project."""
    cfg = load_section(project_dir, "reprune")
    return [
        pruning_pipeline.to_deployment(
            name="pipeline", parameters={"project_dir": project_dir}, concurrency_limit=ONE_AT_A_TIME
        ),
        drift_check.to_deployment(
            name="drift-check", cron=cfg.drift_check_cron, parameters={"project_dir": project_dir}
        ),
        reprune.to_deployment(
            name="reprune",
            parameters={"project_dir": project_dir, "reason": "manual"},
            concurrency_limit=ONE_AT_A_TIME,
            triggers=[
                DeploymentEventTrigger(
                    name="re-prune on drift",
                    expect={DRIFT_EVENT},
                    match=DRIFT_RESOURCE,
                    parameters={"project_dir": project_dir, "reason": "drift alert"},
                )
            ],
        ),
    ]


def main() -> None:
    """Entry point of `make deploy`."""
    parser = argparse.ArgumentParser(description="Serve the PruneOps Prefect deployments.")
    parser.add_argument("--project-dir", default=str(Path.cwd()))
    args = parser.parse_args()
    serve(*build_deployments(args.project_dir))


if __name__ == "__main__":
    main()
