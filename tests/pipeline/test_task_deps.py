"""A project's DVC deps are its own task's code: editing the other task's modules leaves it up to date.

Two projects, a classifier and a causal LM, get `dvc.yaml` from the stage table against a copy of
the package (so the test can edit modules without touching this checkout), every stage recorded
by `dvc commit` over stand-in outputs; then a decoder-only module and a classifier-only module are
edited in turn, and `dvc status` is asked of both projects.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pruneops
from pruneops.core.params import read_params
from pruneops.pipeline import dvcfile
from pruneops.pipeline.stages import STAGES, load_configs, task_of
from tests.conftest import tiny_params, write_params
from tests.decoder_helpers import decoder_params

DECODER_ONLY = "pruning/decoder_cuts.py"
CLASSIFIER_ONLY = "pruning/methods.py"


def _dvc(cwd: Path, *args: str) -> str:
    env = {**os.environ, "DVC_NO_ANALYTICS": "1", "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@localhost",
           "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@localhost"}  # fmt: skip
    dvc = str(Path(sys.executable).parent / "dvc")
    done = subprocess.run([dvc, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return done.stdout


def _project(root: Path, params: dict) -> Path:
    """A git + DVC project with these params, its dvc.yaml, and every stage committed over stand-in outputs."""
    root.mkdir(parents=True, exist_ok=True)
    write_params(root, params)
    dvcfile.write_dvc_yaml(root)
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    _dvc(root, "init", "-q")
    configs = load_configs(read_params(root / "params.yaml"))
    task = task_of(configs)
    for stage in STAGES:
        out = root / "artifacts" / stage.name
        out.mkdir(parents=True, exist_ok=True)
        (out / "stand-in.txt").write_text(stage.name)
        (root / "metrics").mkdir(exist_ok=True)
        (root / "metrics" / f"{stage.name}.json").write_text("{}")
        for plot in stage.impl(task).plots:
            path = root / "plots" / stage.name / plot.file
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text("[]")
    _dvc(root, "commit", "-f", "-q")
    return root


def _stale(root: Path) -> bool:
    return "up to date" not in _dvc(root, "status")


def test_editing_one_tasks_module_leaves_the_other_tasks_project_up_to_date(tmp_path, monkeypatch):
    package = tmp_path / "site" / "pruneops"
    shutil.copytree(Path(pruneops.__file__).parent, package, ignore=shutil.ignore_patterns("__pycache__"))
    monkeypatch.setattr(dvcfile, "PACKAGE_DIR", package)
    model, corpus = tmp_path / "model", tmp_path / "corpus.txt"
    model.mkdir()
    (model / "config.json").write_text("{}")
    corpus.write_text("text")
    classifier = _project(tmp_path / "classifier", tiny_params())
    decoder = _project(tmp_path / "decoder", decoder_params(model, corpus))
    assert not _stale(classifier) and not _stale(decoder)

    for edited, changes, stays in ((DECODER_ONLY, decoder, classifier), (CLASSIFIER_ONLY, classifier, decoder)):
        module = package / edited
        original = module.read_text()
        module.write_text(original + "\n# edited\n")
        assert _stale(changes), edited  # its own task's project sees the change ...
        assert not _stale(stays), edited  # ... the other task's does not
        module.write_text(original)
