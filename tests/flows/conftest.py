"""A Prefect test server for the session, and a scratch DVC project."""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import tiny_params, write_params

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
    """A committed git + DVC project with tiny params and its generated dvc.yaml."""
    from pruneops.pipeline.dvcfile import write_dvc_yaml
    from pruneops.pipeline.experiments import tool_env

    root.mkdir(parents=True, exist_ok=True)
    write_params(root, tiny_params(**sections))
    write_dvc_yaml(root)
    (root / ".gitignore").write_text("/state/\n/models/\n/data/feedback/\n")
    for cmd in (
        ["git", "init", "-q"],
        ["dvc", "init", "-q"],
        ["dvc", "config", "core.analytics", "false"],
        ["git", "add", "-A"],
        ["git", "commit", "-qm", "project"],
    ):
        subprocess.run(cmd, cwd=root, env=tool_env(), check=True, capture_output=True)
    return root
