"""Prefect tasks over the stage table: one task per DVC stage, and a DVC experiment task."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from pruneops.core.errors import ConfigError
from pruneops.core.io import Layout, read_json
from pruneops.pipeline.experiments import Experiment, run_experiment, run_logged
from pruneops.pipeline.runner import outcome_path, read_outcome
from pruneops.pipeline.stages import STAGE_NAMES

STAGES = STAGE_NAMES


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its error line and exit code."""

    def __init__(self, stage: str, exit_code: int | None, error_line: str):
        super().__init__(f"stage {stage} failed (exit {exit_code}): {error_line}")
        self.stage = stage
        self.exit_code = exit_code


def _transient(task, task_run, state) -> bool:
    """Retry unless the failure is a bad param (that fails the same way every time)."""
    exc = state.result(raise_on_failure=False)
    return not isinstance(exc, ConfigError) and not (
        isinstance(exc, StageFailed) and exc.exit_code == ConfigError.exit_code
    )


@task(retries=2, retry_delay_seconds=3, retry_condition_fn=_transient, task_run_name="dvc-{stage}")
def run_stage(stage: str, project_dir: str = ".") -> dict[str, Any]:
    """Reproduces one DVC stage in the workspace (a no-op when nothing changed); returns its metrics.

    Raises:
        StageFailed: The stage failed; its own error line is in the message.
    """
    logger = get_run_logger()
    outcome_path(project_dir, stage).unlink(missing_ok=True)  # what follows is this run's, or none
    code, tail = run_logged(["dvc", "repro", "--single-item", stage], Path(project_dir), logger.info)
    if code != 0:
        outcome = read_outcome(project_dir, stage)
        if outcome is not None and outcome.exit_code != 0:  # the stage ran and said why it failed
            raise StageFailed(stage, outcome.exit_code, outcome.error)
        raise StageFailed(stage, None, tail[-1] if tail else f"dvc repro exited {code}")  # DVC stopped first
    return read_json(Layout(Path(project_dir)).metrics(stage))


@task(retries=0, task_run_name="dvc-exp-{name}")
def run_experiment_task(project_dir: str, overrides: dict[str, Any], name: str) -> Experiment:
    """Runs the pipeline with `overrides` as a DVC experiment (the workspace is left as it is)."""
    return run_experiment(Path(project_dir), overrides, name, get_run_logger().info)
