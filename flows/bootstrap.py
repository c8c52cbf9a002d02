"""Container start-up: apply params overrides, then make sure a model is in production.

python -m flows.bootstrap --project-dir /app      # what the worker image runs before `flows.deploy`

`PRUNEOPS_SET="reprune.drift_source=http://prometheus:9090 prune.target_ratio=0.7"` sets params
the way `dvc exp run -S` does (validated; params.yaml is unchanged if one is bad). With nothing in
production, the pipeline flow runs once and its pruned INT8 model is published: a first
deployment has something to serve and to compare the next re-prune against.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

import yaml
from prefect import flow, get_run_logger

from flows.pipeline import pruning_pipeline
from pruneops.cli import main as publish_cli
from pruneops.model_registry import ModelRegistry
from tasks.params import apply_overrides, reprune_config


def parse_overrides(text: str) -> dict[str, Any]:
    """`"a.b=1 c.d=x"` -> `{"a.b": 1, "c.d": "x"}` (values read as YAML, as `dvc exp run -S` does)."""
    overrides = {}
    for item in text.split():
        key, sep, value = item.partition("=")
        if not sep or not key:
            raise ValueError(f"PRUNEOPS_SET: expected section.key=value, got {item!r}")
        overrides[key] = yaml.safe_load(value)
    return overrides


@flow(name="bootstrap", log_prints=True)
def bootstrap(project_dir: str = ".") -> dict[str, Any]:
    """Runs the pipeline and publishes its model when nothing is in production yet."""
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    registry = ModelRegistry(project / reprune_config(project).registry_dir)
    production = registry.production()
    if production is not None:
        logger.info("production model %s present; nothing to do", production.version)
        return {"production": production.version, "published": False}
    pruning_pipeline(project_dir=str(project))
    # `pruneops publish` records params, metrics and the git revision with the model.
    if publish_cli(["--root", str(project), "publish"]) != 0:
        raise RuntimeError("pruneops publish failed (its error is logged above)")
    logger.info("published the first model: %s", registry.production().version)
    return {"production": registry.production().version, "published": True}


def main() -> None:
    """Entry point of the worker image's start-up."""
    parser = argparse.ArgumentParser(description="Apply PRUNEOPS_SET, then publish a first model if none is served.")
    parser.add_argument("--project-dir", default=str(Path.cwd()))
    parser.add_argument("--overrides-only", action="store_true", help="apply PRUNEOPS_SET and stop")
    args = parser.parse_args()
    overrides = parse_overrides(os.environ.get("PRUNEOPS_SET", ""))
    if overrides:
        apply_overrides.fn(args.project_dir, overrides)
        print(f"params.yaml: set {overrides}")
    if not args.overrides_only:
        bootstrap(args.project_dir)


if __name__ == "__main__":
    main()
