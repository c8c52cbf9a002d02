"""Experiment worktrees: a rerun replaces what an interrupted run left behind."""

import subprocess

import pytest

from pruneops.errors import PruneOpsError
from pruneops.experiments import _make_worktree, tool_env


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=tool_env(), capture_output=True, text=True, check=True).stdout


def test_a_rerun_replaces_the_worktree_a_killed_run_left(tmp_path):
    project = tmp_path / "p"
    project.mkdir()
    _git(project, "init", "-q")
    (project / "params.yaml").write_text("prune: {}\n")
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "params")
    tree, _ = _make_worktree(project, "dense")  # a killed `pruneops bench` leaves this, unremoved
    (tree / "half-written").write_text("from the killed run")
    with pytest.raises(PruneOpsError, match="an experiment named 'dense' is already there"):
        _make_worktree(project, "dense")
    again, root = _make_worktree(project, "dense", replace=True)
    assert again == tree and (root / "params.yaml").is_file() and not (tree / "half-written").exists()
    assert _git(project, "worktree", "list").count(str(tree)) == 1
