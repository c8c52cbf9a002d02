"""`pruning_pipeline`: the stages in order, in the workspace or, with overrides, as a DVC experiment."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from pruneops.core.params import read_params
from pruneops.pipeline.experiments import apply_overrides, project_lock
from pruneops.reports.summary import summary_markdown
from tasks.stages import STAGES, run_experiment_task, run_stage


@flow(name="pruning-pipeline", log_prints=True)
def pruning_pipeline(overrides: dict[str, Any] | None = None, project_dir: str = ".") -> dict[str, Any]:
    """Runs validate -> ... -> benchmark through DVC and publishes a summary artifact.

    Args:
        overrides: Dotted param keys and values (e.g. `{"prune.target.value": 0.7}`), validated
            before anything runs. With overrides the run is a DVC experiment in its own worktree
            (`pruneops.pipeline.experiments`); `params.yaml` is never written.
        project_dir: The PruneOps project (where dvc.yaml lives).

    Returns:
        Each stage's metrics; with overrides also `experiment`, its name (`dvc exp show -A`
        lists it, `dvc exp apply` brings its outputs into the workspace).
    """
    project = Path(project_dir).resolve()
    if overrides:
        apply_overrides(read_params(project / "params.yaml"), overrides)  # refuse bad ones before the lock
    with project_lock(project, "pruning-pipeline"):
        if overrides:
            experiment = run_experiment_task(str(project), overrides, f"pipeline-{time.strftime('%Y%m%d-%H%M%S')}")
            metrics: dict[str, Any] = experiment.metrics()
            where = f"experiment {experiment.name}"
            experiment.remove()  # its outputs stay in the DVC cache, its record in git refs
        else:
            metrics = {stage: run_stage(stage, str(project)) for stage in STAGES}
            where = "workspace"
    create_markdown_artifact(
        summary_markdown(metrics["benchmark"], where),
        key="pruning-summary",
        description="dense vs pruned vs what ships",
    )
    if overrides:
        metrics["experiment"] = experiment.name
    return metrics
