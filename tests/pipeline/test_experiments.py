"""Experiment worktrees: a rerun replaces what an interrupted run left behind."""

import subprocess

import pytest

from pruneops.core.errors import ConfigError, PruneOpsError
from pruneops.pipeline.experiments import _make_worktree, apply_overrides, tool_env
from tests.conftest import ROOT


def _git(cwd, *args: str) -> str:
    return subprocess.run(["git", *args], cwd=cwd, env=tool_env(), capture_output=True, text=True, check=True).stdout


def _committed_project(root):
    """A git repository holding a committed params.yaml: what an experiment worktree is made from."""
    project = root / "p"
    project.mkdir()
    _git(project, "init", "-q")
    (project / "params.yaml").write_text("prune: {}\n")
    _git(project, "add", "-A")
    _git(project, "commit", "-qm", "params")
    return project


def test_a_rerun_replaces_the_worktree_a_killed_run_left(tmp_path):
    project = _committed_project(tmp_path)
    tree, _ = _make_worktree(project, "dense")  # a killed `pruneops bench` leaves this, unremoved
    (tree / "half-written").write_text("from the killed run")
    with pytest.raises(PruneOpsError, match="an experiment named 'dense' is already there"):
        _make_worktree(project, "dense")
    again, root = _make_worktree(project, "dense", replace=True)
    assert again == tree and (root / "params.yaml").is_file() and not (tree / "half-written").exists()
    assert _git(project, "worktree", "list").count(str(tree)) == 1


def test_experiments_share_the_projects_cache_and_it_outlives_a_replaced_worktree(tmp_path):
    """A recovery checkpoint written in an experiment that was stopped is there for its rerun."""
    project = _committed_project(tmp_path)
    _, root = _make_worktree(project, "ours")
    (root / "state" / "cache" / "recovery").mkdir()
    (root / "state" / "cache" / "recovery" / "recovery-0123.pt").write_text("progress")
    _, again = _make_worktree(project, "ours", replace=True)
    _, other = _make_worktree(project, "depth")
    for where in (project, again, other):
        assert (where / "state" / "cache" / "recovery" / "recovery-0123.pt").read_text() == "progress"


def test_an_override_sets_a_key_inside_a_nested_block_and_keeps_its_siblings():
    from pruneops.core.errors import ConfigError
    from pruneops.pipeline.experiments import apply_overrides
    from tests.conftest import tiny_params

    params = tiny_params()
    out = apply_overrides(params, {"prune.target.value": 0.3, "prune.gate.min_speedup": 1.2})
    assert out["prune"]["target"] == {**params["prune"]["target"], "value": 0.3}
    assert out["prune"]["gate"] == {**params["prune"]["gate"], "min_speedup": 1.2}
    assert params["prune"]["target"]["value"] == 0.5  # a copy
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


@pytest.mark.parametrize(
    "overrides",
    [
        {"train.model": "os:system"},
        {"train.model_kwargs": {"factory": "subprocess:run"}},
        {"prune.target": {"kind": "macs", "value": 0.5, "reference": ["pathlib:Path"]}},
    ],
)
def test_an_override_that_names_code_is_refused_with_exit_2(overrides):
    from pruneops.core.params import read_params

    with pytest.raises(ConfigError, match="a value naming code .* is read from params.yaml only") as raised:
        apply_overrides(read_params(ROOT / "params.yaml"), overrides)
    assert raised.value.exit_code == 2


def test_prunops_set_refuses_a_value_that_names_code():
    from pruneops.core.params import environment_overrides

    with pytest.raises(ConfigError, match="PRUNEOPS_SET: reprune.drift_source: a value naming code"):
        environment_overrides("reprune.drift_source=os:system")
    assert environment_overrides("reprune.drift_source=http://prometheus:9090") == {
        "reprune.drift_source": "http://prometheus:9090"
    }


def test_validating_a_user_factory_neither_imports_nor_calls_it(tmp_path, monkeypatch):
    from pruneops.config import TrainConfig
    from pruneops.core.params import parse_section
    from pruneops.models import ModelSpec, create_model

    marker = tmp_path / "imported"
    (tmp_path / "side_effects.py").write_text(
        f"import pathlib\npathlib.Path({str(marker)!r}).write_text('x')\n"
        "from tests.models.factories import tiny_linear as build\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = parse_section("train", {"model": "side_effects:build"}, TrainConfig)
    assert config.model == "side_effects:build" and not marker.exists()
    create_model(ModelSpec(config.model, [4], 3))  # the stage imports it
    assert marker.exists()


@pytest.mark.slow(reason="a DVC experiment in a git worktree (about 40 s on 2 cores)")
def test_a_failed_experiment_names_the_failing_stage_s_own_error_line(tmp_path):
    """The line comes from what the stage recorded, not from DVC's wording of the failure."""
    pytest.importorskip("prefect", reason="the scratch project helper lives with the flow tests")
    import numpy as np

    from pruneops.pipeline.experiments import ExperimentFailed, run_experiment
    from tests.flows.conftest import make_project

    rng = np.random.default_rng(0)
    x = rng.random((60, 4, 4)).astype(np.float32)
    x[3, 1, 1] = np.nan  # validate refuses it when it runs, not when params load
    (tmp_path / "p").mkdir()
    data = tmp_path / "p" / "d.npz"
    np.savez(
        data,
        x_train=x,
        y_train=np.arange(60) % 3,
        x_test=rng.random((20, 4, 4)).astype(np.float32),
        y_test=np.arange(20) % 3,
    )
    project = make_project(tmp_path / "p", validate={"dataset": "npz", "path": "d.npz"})
    with pytest.raises(ExperimentFailed) as failed:
        run_experiment(project, {"prune.target.value": 0.4}, "broken", log=lambda line: None)
    message = str(failed.value)
    assert message.startswith("experiment broken failed: pruneops validate: error: data validation failed: 1 of 10 ")
    assert "n_nonfinite" in message and "\n" not in message
    assert not (project / "state" / "experiments" / "broken").exists()  # the worktree is removed
