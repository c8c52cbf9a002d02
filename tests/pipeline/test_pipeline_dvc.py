"""The whole pipeline through DVC on digits with tiny epochs: repro, no-op repro, dvc exp run -S."""

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pruneops.pipeline.dvcfile import write_dvc_yaml
from pruneops.pipeline.stages import STAGE_NAMES as STAGES
from tests.conftest import tiny_params, write_params


def _sh(cwd: Path, *cmd: str, timeout: int = 600) -> subprocess.CompletedProcess:
    env = {
        **os.environ,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "DVC_NO_ANALYTICS": "1",
        "GIT_AUTHOR_NAME": "t",
        "GIT_AUTHOR_EMAIL": "t@localhost",
        "GIT_COMMITTER_NAME": "t",
        "GIT_COMMITTER_EMAIL": "t@localhost",
    }
    result = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)
    assert result.returncode == 0, f"{' '.join(cmd)} failed:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


def repro_new_project(root: Path, params: dict, timeout: int = 1200) -> str:
    """Writes `params` and the generated `dvc.yaml` into a new git + DVC project; `dvc repro`'s output."""
    from pruneops.pipeline.dvcfile import write_dvc_yaml
    from tests.conftest import write_params

    write_params(root, params)
    write_dvc_yaml(root)
    dvc = str(Path(sys.executable).parent / "dvc")
    _sh(root, "git", "init", "-q")
    _sh(root, dvc, "init", "-q")
    return _sh(root, dvc, "repro", timeout=timeout).stdout


@pytest.mark.e2e
@pytest.mark.slow(reason="two dvc repro runs and a dvc exp run: fifteen stage processes")
def test_dvc_repro_then_noop_then_experiment(tmp_path):
    write_params(tmp_path, tiny_params())
    write_dvc_yaml(tmp_path)  # code deps point at this checkout's pruneops (outside the project)
    dvc = str(Path(sys.executable).parent / "dvc")
    _sh(tmp_path, "git", "init", "-q")
    _sh(tmp_path, dvc, "init", "-q")
    _sh(tmp_path, dvc, "config", "core.analytics", "false")

    out = _sh(tmp_path, dvc, "repro").stdout
    assert [s for s in STAGES if f"Running stage '{s}'" in out] == list(STAGES)
    bench = json.loads((tmp_path / "metrics/benchmark.json").read_text())
    assert bench["mac_reduction"] > 1.5

    started = time.perf_counter()
    again = _sh(tmp_path, dvc, "repro").stdout
    assert "Running stage" not in again and "up to date" in again
    assert time.perf_counter() - started < 10

    _sh(tmp_path, "git", "add", "-A")
    _sh(tmp_path, "git", "commit", "-qm", "baseline run")
    # One experiment (each costs a pipeline's worth of stage start-ups): a latency target timed in
    # static INT8. The units are timed, the accuracy sweep is reused, and DVC compares the metrics.
    latency = (
        "prune.target.kind=latency_ratio",
        "prune.target.value=0.8",
        "prune.target.batch=1",
        "prune.target.form=static",
    )
    exp = _sh(tmp_path, dvc, "exp", "run", *(a for s in latency for a in ("-S", s))).stdout
    assert "Running stage 'latency'" in exp and "Running stage 'prune'" in exp
    assert "Running stage 'sensitivity'" not in exp and "Running stage 'train'" not in exp
    timed = json.loads((tmp_path / "metrics/latency.json").read_text())
    assert timed["measured"] is True and timed["form"] == "static" and timed["units"] > 0
    prune = json.loads((tmp_path / "metrics/prune.json").read_text())
    assert prune["latency_form"] == "static" and prune["target_value"] == 0.8
    diff = _sh(tmp_path, dvc, "metrics", "diff", "--json").stdout
    assert "metrics/prune.json" in json.loads(diff)
