"""A Prefect test server for the session, and a scratch DVC project."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT, tiny_params, write_params

pytest.importorskip("prefect", reason="prefect (the `orchestration` extra) is not installed")


@pytest.fixture(scope="session", autouse=True)
def prefect_server(tmp_path_factory):
    """Prefect state under a temporary directory, analytics off, one test server."""
    home = tmp_path_factory.mktemp("prefect-home")
    os.environ.update(
        {
            "PREFECT_HOME": str(home),
            "PREFECT_SERVER_ANALYTICS_ENABLED": "false",
            "DO_NOT_TRACK": "1",
            "PREFECT_LOGGING_LEVEL": "WARNING",
        }
    )
    from prefect.testing.utilities import prefect_test_harness

    with prefect_test_harness(server_startup_timeout=120):
        yield


def make_project(root: Path, **sections) -> Path:
    """A git + DVC project with this repo's dvc.yaml and tiny params."""
    root.mkdir(parents=True, exist_ok=True)
    shutil.copy(ROOT / "dvc.yaml", root / "dvc.yaml")
    shutil.copytree(ROOT / "pruneops", root / "pruneops", ignore=shutil.ignore_patterns("__pycache__"))
    write_params(root, tiny_params(**sections))
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["dvc", "config", "core.analytics", "false"]):
        subprocess.run(cmd, cwd=root, env=env, check=True, capture_output=True)
    return root
