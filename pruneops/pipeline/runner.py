"""Runs one stage: params validated, declared DVC deps checked under `dvc repro`, then the stage function.

Each stage command also records how it ended (`StageOutcome`, under `state/outcomes/`), so that what
drives a stage through DVC (the Prefect tasks) reads its exit code and error line from the stage
itself rather than from DVC's wording of a failure.
"""

from __future__ import annotations

import contextlib
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path

from pruneops.core.io import Layout, dump_json, read_json
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


@dataclass(frozen=True)
class StageOutcome:
    """How one stage command ended.

    Attributes:
        stage: The stage's name.
        exit_code: The command's exit code (0: it wrote its outputs).
        error: Its one error line as printed (`pruneops <stage>: error: ...`); empty on success.
        seconds: How long the command ran.
    """

    stage: str
    exit_code: int
    error: str
    seconds: float


def outcome_path(root: str | Path, stage: str) -> Path:
    """Where the last run of `stage` in the project at `root` recorded its outcome."""
    return Layout(Path(root)).state_dir() / "outcomes" / f"{stage}.json"


def record_outcome(root: str | Path, outcome: StageOutcome) -> None:
    """Writes `outcome`; where `state/` cannot be written the stage's exit code and stderr still say it."""
    with contextlib.suppress(OSError):
        dump_json(asdict(outcome), outcome_path(root, outcome.stage))


def read_outcome(root: str | Path, stage: str) -> StageOutcome | None:
    """The outcome `stage` last recorded in the project at `root`; None when it recorded none."""
    path = outcome_path(root, stage)
    return StageOutcome(**read_json(path)) if path.is_file() else None
