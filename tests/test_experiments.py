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


def test_an_override_sets_a_key_inside_a_nested_block_and_keeps_its_siblings():
    from pruneops.errors import ConfigError
    from pruneops.experiments import apply_overrides
    from tests.conftest import tiny_params

    params = tiny_params()
    out = apply_overrides(params, {"prune.target.value": 0.3, "prune.gate.min_speedup": 1.2})
    assert out["prune"]["target"] == {**params["prune"]["target"], "value": 0.3}
    assert out["prune"]["gate"] == {"min_speedup": 1.2} and params["prune"]["target"]["value"] == 0.5  # a copy
    # A block the params leave null is created around the key.
    bare = {**params, "prune": {**params["prune"], "target": None}}
    assert apply_overrides(bare, {"prune.target.kind": "ratio", "prune.target.value": 0.4})["prune"]["target"] == {
        "kind": "ratio",
        "value": 0.4,
    }
    with pytest.raises(ConfigError, match=r"override 'prune.steps.x': prune.steps is not a mapping"):
        apply_overrides(params, {"prune.steps.x": 1})
    with pytest.raises(ConfigError, match=r"override 'prune': expected section.key"):
        apply_overrides(params, {"prune": 1})
