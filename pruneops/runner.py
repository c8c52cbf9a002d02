"""Runs one stage: params validated, declared DVC deps checked under `dvc repro`, then the stage function."""

from __future__ import annotations

from pathlib import Path

from pruneops.dvcfile import require_declared_deps
from pruneops.io import Layout
from pruneops.stages import StageReport, get_stage, load_stage_configs, project_importable


def run_stage(stage: str, params_path: str | Path, root: str | Path = ".") -> StageReport:
    """Validates the params, then runs one stage (raises `PruneOpsError` on failure).

    Under `dvc repro` it first checks that `dvc.yaml` declares every file the stage uses.
    """
    with project_importable(root):
        configs = load_stage_configs(params_path, stage)
        declared = get_stage(stage)
        require_declared_deps(declared, configs, Path(root))
        return declared.run(configs, Layout(Path(root)))
