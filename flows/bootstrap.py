"""Container start-up: make sure a model is in production.

python -m flows.bootstrap --project-dir /app      # what the worker image runs before `flows.deploy`

With nothing in production, the pipeline flow runs once in the workspace and its model is
published: a first deployment has something to serve and to compare the next re-prune against.
`PRUNEOPS_SET="reprune.drift_source=http://prometheus:9090"` sets orchestration params in memory
(see `pruneops.config.read_params`); params.yaml is never written.
"""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger

from flows.pipeline import pruning_pipeline
from pruneops.modelstore.store import publish_pipeline_model, registry_from_params


@flow(name="bootstrap", log_prints=True)
def bootstrap(project_dir: str = ".") -> dict[str, Any]:
    """Runs the pipeline and publishes its model when nothing is in production yet."""
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    production = registry_from_params(project).production()
    if production is not None:
        logger.info("production model %s present; nothing to do", production.version)
        return {"production": production.version, "published": False}
    pruning_pipeline(project_dir=str(project))
    published = publish_pipeline_model(project)
    logger.info("published the first model: %s", published["version"])
    return {"production": published["version"], "published": True}


def main() -> None:
    """Entry point of the worker image's start-up."""
    parser = argparse.ArgumentParser(description="Publish a first model if none is served.")
    parser.add_argument("--project-dir", default=str(Path.cwd()))
    bootstrap(parser.parse_args().project_dir)


if __name__ == "__main__":
    main()
