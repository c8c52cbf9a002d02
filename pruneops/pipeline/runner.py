"""Runs one stage: params validated, declared DVC deps checked under `dvc repro`, then the stage function."""

from __future__ import annotations

from functools import partial
from pathlib import Path

from pruneops.core.io import Layout
from pruneops.pipeline.compute import run_on_timing_node
from pruneops.pipeline.dvcfile import require_declared_deps
from pruneops.pipeline.stages import Stage, StageReport, get_stage, load_stage_configs, project_importable


def run_stage(stage: str, params_path: str | Path, root: str | Path = ".") -> StageReport:
    """Validates the params, then runs one stage (raises `PruneOpsError` on failure).

    Under `dvc repro` it first checks that `dvc.yaml` declares every file the stage uses. With
    `compute.timing_resource` on Ray, a timed stage runs whole on the node that resource marks.
    """
    with project_importable(root):
        configs = load_stage_configs(params_path, stage)
        declared = get_stage(stage)
        require_declared_deps(declared, configs, Path(root))
        compute = configs.get("compute")
        if declared.timed and compute is not None and compute.backend == "ray" and compute.timing_resource:
            layout = Layout(Path(root).resolve())  # the timing node sees the project at the same path
            return run_on_timing_node(partial(_run_here, declared, configs, layout), compute, layout.root)
        return declared.run(configs, Layout(Path(root)))


def _run_here(declared: Stage, configs: dict, layout: Layout) -> StageReport:
    """The stage in this process, its project importable (on the timing node, a Ray worker)."""
    with project_importable(layout.root):
        return declared.run(configs, layout)
