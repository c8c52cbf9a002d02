"""The gated re-prune: promotion only when at least as good, one run per burst, rollback."""

import json
import shutil
import subprocess
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

import flows.reprune as reprune_module
from flows.drift import drift_check
from flows.reprune import reprune
from pruneops.cli import main as cli_main
from pruneops.core.integrity import write_checksum
from pruneops.core.io import Layout
from pruneops.modelstore.store import ModelRegistry
from tests.conftest import digits_onnx
from tests.flows.conftest import make_project


@pytest.fixture(scope="module")
def onnx_models(tmp_path_factory):
    """A trained and an untrained digits MLP as ONNX, and the prepared data."""
    root = tmp_path_factory.mktemp("models")
    data_dir, _, _ = digits_onnx(root, name="good.onnx")
    digits_onnx(root, trained=False, name="bad.onnx")
    return root, data_dir


@dataclass(frozen=True)
class FakeExperiment:
    """What `run_experiment` returns, made from a prepared ONNX model instead of a pipeline run."""

    name: str
    root: Path

    @property
    def layout(self):
        return Layout(self.root)

    def metrics(self):
        return {"benchmark": {"model": self.name}}

    def remove(self):
        shutil.rmtree(self.root, ignore_errors=True)


@pytest.fixture
def stub_pipeline(monkeypatch, onnx_models, tmp_path):
    """Replaces the DVC experiment by one that 'produces' the model named in `choice`."""
    root, data_dir = onnx_models
    choice = {"model": "good", "delay": 0.0, "overrides": []}

    def fake_experiment(project_dir, overrides, name):
        time.sleep(choice["delay"])
        choice["overrides"].append(overrides)
        exp = tmp_path / "experiments" / name
        (exp / "artifacts/export").mkdir(parents=True)
        shutil.copyfile(root / f"{choice['model']}.onnx", exp / "artifacts/export/pruned_deployed.onnx")
        write_checksum(exp / "artifacts/export/pruned_deployed.onnx")
        shutil.copytree(data_dir, exp / "artifacts/validate")
        shutil.copy(Path(project_dir) / "params.yaml", exp / "params.yaml")
        return FakeExperiment(name, exp)

    monkeypatch.setattr(reprune_module, "run_experiment_task", fake_experiment)
    return choice


@pytest.fixture
def project(tmp_path):
    """A project and new labelled data as the serving app collects it (inputs scaled to [0, 1])."""
    from sklearn.datasets import load_digits

    project = make_project(tmp_path / "proj")
    new = tmp_path / "new_data.npz"
    digits = load_digits()
    x, y = (digits.images / 16.0).astype(np.float32)[:, None], digits.target.astype(np.int64)
    np.savez(new, x_train=x[:1400], y_train=y[:1400], x_test=x[1400:], y_test=y[1400:])
    return project, new


def test_better_candidates_promoted_worse_kept_out_and_rollback(project, stub_pipeline):
    project, new = project
    registry = ModelRegistry(project / "models")

    first = reprune(data_path=str(new), project_dir=str(project))
    assert first["promoted"] and first["production_version_before"] is None
    assert (project / "data/incoming/new_data.npz.dvc").exists()  # the data is versioned
    # The experiment reads the new data; the workspace's data source is not touched.
    assert stub_pipeline["overrides"][0] == {
        "validate.dataset": "npz",
        "validate.path": str((project / "data/incoming/new_data.npz").resolve()),
    }
    assert subprocess.run(["git", "diff", "--quiet", "params.yaml"], cwd=project).returncode == 0
    assert first["candidate_version"] == registry.production().version

    stub_pipeline["model"] = "bad"
    worse = reprune(data_path=str(new), project_dir=str(project))
    assert not worse["promoted"]
    assert any("holdout accuracy" in r and "<" in r for r in worse["reasons"])
    assert registry.production().version == first["candidate_version"]

    stub_pipeline["model"] = "good"
    better = reprune(data_path=str(new), project_dir=str(project), reason="drift alert")
    assert better["promoted"] and better["production_version_before"] == first["candidate_version"]
    decision = json.loads((project / "models/decisions" / f"{better['candidate_version']}.json").read_text())
    assert decision["reason"] == "drift alert" and decision["candidate"]["latency_ms_b1"] > 0

    assert cli_main(["--root", str(project), "rollback"]) == 0
    assert registry.production().version == first["candidate_version"]
    assert registry.get(better["candidate_version"]).path.exists()


def test_two_triggers_in_quick_succession_give_one_reprune(project, stub_pipeline):
    project, new = project
    stub_pipeline["delay"] = 3.0
    results = []

    def trigger():
        results.append(reprune(data_path=str(new), project_dir=str(project), reason="drift alert"))

    threads = [threading.Thread(target=trigger) for _ in range(2)]
    for t in threads:
        t.start()
        time.sleep(0.5)
    for t in threads:
        t.join(timeout=120)
    assert len(results) == 2
    assert sorted("skipped" in r for r in results) == [False, True]
    assert len(ModelRegistry(project / "models").versions()) == 1


def test_drift_check_reads_report_and_triggers_above_threshold(tmp_path):
    project = make_project(tmp_path)
    report = tmp_path / "drift.json"
    params = (project / "params.yaml").read_text().replace("http://127.0.0.1:9090", str(report))
    (project / "params.yaml").write_text(params)
    assert drift_check(project_dir=str(project))["score"] is None
    report.write_text(json.dumps({"overall": 0.05}))
    assert drift_check(project_dir=str(project))["triggered"] is False
    report.write_text(json.dumps({"overall": 0.4}))
    assert drift_check(project_dir=str(project)) == {"score": 0.4, "threshold": 0.2, "triggered": True}


@pytest.mark.e2e
@pytest.mark.slow(reason="a real re-prune: every stage as a DVC experiment on new data")
def test_a_real_reprune_runs_a_dvc_experiment_and_leaves_the_workspace_params_alone(project):
    project, new = project
    before = (project / "params.yaml").read_text()
    record = reprune(data_path=str(new), project_dir=str(project), reason="feedback")
    assert record["promoted"] and record["experiment"].startswith("reprune-")
    assert subprocess.run(["git", "diff", "--exit-code", "params.yaml"], cwd=project).returncode == 0
    assert (project / "params.yaml").read_text() == before
    assert not (project / "artifacts").exists()  # the workspace's pipeline outputs were not touched
    assert not list((project / "state/experiments").iterdir())  # the worktree is gone
    exps = subprocess.run(
        ["dvc", "exp", "list", "--all-commits", "--name-only"], cwd=project, capture_output=True, text=True
    )
    assert record["experiment"] in exps.stdout  # DVC recorded it
    version = ModelRegistry(project / "models").get(record["candidate_version"])
    assert version.metadata["params"]["validate"]["path"].endswith("data/incoming/new_data.npz")


def test_a_text_project_reprunes_on_the_served_texts(tmp_path):
    from tests.conftest import tiny_params, write_params

    write_params(tmp_path, tiny_params(validate={"dataset": "text", "path": "reviews.csv", "tokenizer": "tok.json"}))
    assert reprune_module.default_feedback(tmp_path, "feedback").name == "feedback.csv"
    overrides = reprune_module.dataset_overrides(tmp_path, "feedback/feedback.csv")
    assert overrides == {
        "validate.path": str(tmp_path / "feedback/feedback.csv"),
        "validate.text_column": "text",
        "validate.label_column": "label",
        "validate.exclude_labels": None,
    }
    write_params(tmp_path, tiny_params())
    assert reprune_module.default_feedback(tmp_path, "feedback").name == "feedback.npz"
    assert reprune_module.dataset_overrides(tmp_path, "new.npz")["validate.dataset"] == "npz"
