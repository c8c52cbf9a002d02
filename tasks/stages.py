"""One Prefect task per DVC stage: `dvc repro --single-item <stage>`, output in the Prefect log."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections import deque
from pathlib import Path
from typing import Any

from prefect import get_run_logger, task

from pruneops.io import read_json

STAGES = ("validate", "train", "sensitivity", "prune", "finetune", "quantize", "export", "benchmark")
BAD_PARAMS_EXIT = 2


class StageFailed(RuntimeError):
    """A stage exited non-zero; the message carries its error line and exit code."""

    def __init__(self, stage: str, exit_code: int | None, error_line: str):
        super().__init__(f"stage {stage} failed (exit {exit_code}): {error_line}")
        self.stage = stage
        self.exit_code = exit_code


def tool_env() -> dict[str, str]:
    """The environment for dvc/pruneops: this interpreter's bin first, analytics off."""
    bin_dir = str(Path(sys.executable).parent)
    return {
        **os.environ,
        "PATH": f"{bin_dir}:{os.environ.get('PATH', '')}",
        "DVC_NO_ANALYTICS": "1",
        "GX_ANALYTICS_ENABLED": "false",
        "DO_NOT_TRACK": "1",
    }


def _transient(task, task_run, state) -> bool:
    """Retry unless the stage rejected its params (that fails the same way every time)."""
    exc = state.result(raise_on_failure=False)
    return not (isinstance(exc, StageFailed) and exc.exit_code == BAD_PARAMS_EXIT)


def run_streamed(cmd: list[str], cwd: str, logger) -> tuple[int, list[str]]:
    """Runs `cmd`, logging each output line as it comes; returns (exit code, last lines)."""
    tail: deque[str] = deque(maxlen=40)
    with subprocess.Popen(
        cmd, cwd=cwd, env=tool_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1
    ) as proc:
        for line in proc.stdout:
            line = line.rstrip()
            tail.append(line)
            logger.info(line)
    return proc.returncode, list(tail)


@task(retries=2, retry_delay_seconds=3, retry_condition_fn=_transient, task_run_name="dvc-{stage}")
def run_stage(stage: str, project_dir: str = ".") -> dict[str, Any]:
    """Reproduces one DVC stage (a no-op when nothing changed) and returns its metrics.

    Raises:
        StageFailed: The stage failed; its own error line is in the message.
    """
    logger = get_run_logger()
    code, tail = run_streamed(["dvc", "repro", "--single-item", stage], project_dir, logger)
    if code != 0:
        errors = [line for line in tail if f"pruneops {stage}: " in line and "error" in line]
        exited = [m.group(1) for line in tail for m in [re.search(r"exited with (\d+)", line)] if m]
        raise StageFailed(
            stage, int(exited[-1]) if exited else code, errors[-1] if errors else tail[-1] if tail else ""
        )
    return read_json(Path(project_dir) / "metrics" / f"{stage}.json")
