"""dvc.yaml from the stage table: complete code deps (import closure), user files, and the checks."""

import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import yaml

from pruneops.core.errors import ConfigError
from pruneops.pipeline.dvcfile import PACKAGE_DIR, check_dvc_yaml, import_closure, render, write_dvc_yaml
from pruneops.pipeline.runner import run_stage
from pruneops.pipeline.stages import STAGE_NAMES, STAGES
from tests.conftest import ROOT, tiny_params, write_params

USER_MODEL = """
from torch import nn


def build(input_shape, num_classes, width=16):
    c = input_shape[0]
    return nn.Sequential(nn.Conv2d(c, width, 3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                         nn.Linear(width, num_classes))
"""


def _rel(path: Path) -> str:
    return path.relative_to(PACKAGE_DIR.parent).as_posix()


def test_the_committed_dvc_yaml_is_complete_for_the_table_and_params():
    assert check_dvc_yaml(ROOT) == []
    declared = yaml.safe_load((ROOT / "dvc.yaml").read_text())["stages"]
    assert list(declared) == list(STAGE_NAMES)


def test_closures_hold_what_each_stage_really_imports():
    sensitivity = {_rel(p) for p in import_closure("pruneops.task.classification.sensitivity")}
    assert {"pruneops/training/fit.py", "pruneops/models/profiling.py", "pruneops/models/checkpoint.py"} <= sensitivity
    assert {"pruneops/models/registry.py", "pruneops/models/architectures.py"} <= sensitivity  # lazy imports too
    finetune = {_rel(p) for p in import_closure("pruneops.task.classification.finetune")}
    assert {"pruneops/pruning/masks.py", "pruneops/training/fit.py"} <= finetune
    assert "pruneops/task/classification/train.py" not in finetune  # no stage imports another
    assert "pruneops/models/profiling.py" in {_rel(p) for p in import_closure("pruneops.task.classification.export")}
    assert "pruneops/models/profiling.py" in {_rel(p) for p in import_closure("pruneops.task.classification.train")}
    # Serving code is no stage's dependency: editing it re-runs nothing.
    assert not any(
        "serving" in _rel(p) for s in STAGES for m in s.modules for p in import_closure(m, "pruneops.pipeline.stages")
    )


def test_removing_a_dep_from_dvc_yaml_fails_the_check(tmp_path):
    doc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    doc["stages"]["sensitivity"]["deps"].remove("pruneops/training/fit.py")
    doc["stages"]["train"]["params"].remove("train.lr")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(doc))
    problems = check_dvc_yaml(ROOT, dvc_yaml=tmp_path / "dvc.yaml")
    assert "stage sensitivity: does not depend on pruneops/training/fit.py, which it uses" in problems
    assert "stage train: does not list param train.lr" in problems
    assert len(problems) == 2


def _project_with_user_model(tmp_path: Path, module: str) -> Path:
    # A module name per test: find_spec answers from sys.modules once a name is imported.
    (tmp_path / f"{module}.py").write_text(USER_MODEL)
    write_params(tmp_path, tiny_params(train={"model": f"{module}:build", "model_kwargs": {}}))
    return tmp_path


def test_a_user_model_module_is_a_dependency_of_every_stage_that_builds_the_model(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    root = _project_with_user_model(tmp_path, "usermodels_a")
    stages = render(root)["stages"]
    users = [name for name, entry in stages.items() if "usermodels_a.py" in entry["deps"]]
    assert users == [s.name for s in STAGES if s.impl("classification").builds_model]
    assert "train" in users and "validate" not in users and "benchmark" not in users


def test_a_latency_reference_model_is_a_dependency_of_the_prune_stage_alone(tmp_path):
    reference = tmp_path / "served" / "model.onnx"
    reference.parent.mkdir()
    reference.write_bytes(b"")
    latency = {"kind": "latency_ratio", "value": 1.0}
    write_params(tmp_path, tiny_params(prune={"target": {**latency, "reference": "served/model.onnx"}}))
    stages = render(tmp_path)["stages"]
    assert [name for name, entry in stages.items() if "served/model.onnx" in entry["deps"]] == ["prune"]
    # Outside the project (a bench variant matching another's export): an absolute path DVC tracks.
    outside = tmp_path.parent / f"{tmp_path.name}-elsewhere.onnx"
    write_params(tmp_path, tiny_params(prune={"target": {**latency, "reference": str(outside)}}))
    assert str(outside) in render(tmp_path)["stages"]["prune"]["deps"]


def test_a_stage_under_dvc_refuses_a_dvc_yaml_that_misses_a_file_it_uses(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    root = _project_with_user_model(tmp_path, "usermodels_b")
    doc = render(root)
    doc["stages"]["train"]["deps"].remove("usermodels_b.py")
    (root / "dvc.yaml").write_text(yaml.safe_dump(doc))
    monkeypatch.setenv("DVC_STAGE", "train")
    monkeypatch.setenv("DVC_ROOT", str(root))
    with pytest.raises(
        ConfigError, match=r"dvc.yaml: stage train: does not depend on usermodels_b.py.*pruneops dvc-yaml"
    ):
        run_stage("train", root / "params.yaml", root)


def _dvc_repo(root: Path) -> tuple[Callable[..., str], str]:
    """`root` made a git and DVC repository; a runner of commands there (each must succeed) and the dvc binary."""
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "DVC_NO_ANALYTICS": "1"}
    dvc = str(Path(sys.executable).parent / "dvc")

    def sh(*cmd: str) -> str:
        out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=600)
        assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-2000:]
        return out.stdout

    sh("git", "init", "-q")
    sh(dvc, "init", "-q")
    return sh, dvc


@pytest.mark.e2e
@pytest.mark.slow
def test_editing_the_user_model_or_pruneops_code_makes_dvc_status_show_the_stages_that_use_it(tmp_path):
    root = _project_with_user_model(tmp_path, "usermodels_c")
    write_dvc_yaml(root)
    sh, dvc = _dvc_repo(root)
    sh(dvc, "repro", "train")
    assert "changed" not in sh(dvc, "status", "train")
    (root / "usermodels_c.py").write_text(USER_MODEL + "\n# a comment changes the file\n")
    status = sh(dvc, "status")
    assert "train:" in status and "usermodels_c.py" in status


def test_a_read_key_inside_a_null_block_names_the_block(tmp_path):
    """semi_structured takes no target: the latency and quantize stages then read `prune.target` itself."""
    from tests.conftest import prune_section

    write_params(tmp_path, tiny_params(prune={"target": {"kind": "ratio", "value": 0.5, "form": "fp32"}}))
    stages = render(tmp_path)["stages"]
    assert {"prune.target.kind", "prune.target.form"} <= set(stages["latency"]["params"])
    write_params(tmp_path, tiny_params(prune=prune_section("semi_structured")))
    stages = render(tmp_path)["stages"]
    assert "prune.target" in stages["latency"]["params"] and "prune.target.kind" not in stages["latency"]["params"]
    assert "prune.target" in stages["quantize"]["params"]
    # A key the file leaves out takes its default from the code (a dependency already): DVC, which
    # refuses a params dependency the file lacks, is not given it.
    write_params(tmp_path, tiny_params(prune={"target": {"kind": "ratio", "value": 0.5}}))
    latency = render(tmp_path)["stages"]["latency"]["params"]
    assert "prune.target.kind" in latency and "prune.target.form" not in latency and "prune.target" not in latency


@pytest.mark.parametrize(
    ("where", "why"),
    [
        ("models/minilm", "excluded by .dvcignore"),  # the model registry
        ("state/assets/minilm", "excluded by .dvcignore"),
        ("data/feedback/minilm", "excluded by .dvcignore"),
        (".dvc/minilm", "inside .dvc/"),
    ],
)
def test_a_user_file_dvc_would_ignore_is_refused_by_dvc_yaml_and_by_the_stage(tmp_path, monkeypatch, where, why):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvcignore").write_text((ROOT / ".dvcignore").read_text())
    (tmp_path / where).mkdir(parents=True)
    write_params(tmp_path, tiny_params(train={"init_weights": f"{where}/w.safetensors"}))
    with pytest.raises(ConfigError, match=rf"^train.init_weights: {where}/w.safetensors .*{why}"):
        render(tmp_path)
    with pytest.raises(ConfigError, match=rf"^train.init_weights: .*{why}"):
        run_stage("train", tmp_path / "params.yaml", tmp_path)


def test_a_user_file_through_a_symlink_into_an_ignored_folder_is_refused_and_a_loop_named(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / ".dvcignore").write_text("/models/\n")
    (tmp_path / "models/m").mkdir(parents=True)
    (tmp_path / "link").symlink_to(tmp_path / "models/m")
    write_params(tmp_path, tiny_params(train={"init_weights": "link/w.safetensors"}))
    with pytest.raises(ConfigError, match="excluded by .dvcignore"):
        render(tmp_path)
    (tmp_path / "loop").symlink_to(tmp_path / "loop")
    write_params(tmp_path, tiny_params(validate={"dataset": "npz", "path": "loop"}))
    with pytest.raises(ConfigError, match="^validate.path: loop is a symlink loop$"):
        render(tmp_path)


def test_the_guides_example_paths_lie_where_dvc_tracks_them():
    import re

    rules = (ROOT / ".dvcignore").read_text().split()
    for doc in [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]:
        for path in re.findall(r"(?:pretrained|tokenizer|init_weights|path): ([\w./-]+)", doc.read_text()):
            top = "/" + path.split("/")[0] + "/"
            assert top not in rules, f"{doc.name}: {path} lies in {top}, which .dvcignore excludes"


def test_a_changed_quality_budget_reruns_quantize_not_the_plan_search(tmp_path):
    """`prune.gate`'s budgets are judged by quantize: changing one leaves prune (and so the recovery) up to date."""
    write_params(tmp_path, tiny_params())
    write_dvc_yaml(tmp_path)
    sh, dvc = _dvc_repo(tmp_path)
    stages = yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"]
    for entry in stages.values():  # stand-in outputs: the lock records hashes, nothing here is run
        for out in [*entry.get("outs", []), *entry.get("metrics", []), *entry.get("plots", [])]:
            path = tmp_path / (next(iter(out)) if isinstance(out, dict) else out)
            path.parent.mkdir(parents=True, exist_ok=True)
            if path.suffix:
                path.write_text("{}")
            else:
                path.mkdir(exist_ok=True)
                (path / "out.json").write_text("{}")
    sh(dvc, "commit", "--force")
    assert "changed" not in sh(dvc, "status")
    params = tiny_params()
    params["prune"]["gate"]["max_accuracy_drop"] = 5.0
    write_params(tmp_path, params)
    status = sh(dvc, "status")
    assert "quantize:" in status and "prune.gate.max_accuracy_drop" in status
    assert "prune:" not in status and "finetune:" not in status
    params["prune"]["gate"]["min_speedup"] = 1.5  # the speed floor is the plan search's own
    write_params(tmp_path, params)
    assert "prune:" in sh(dvc, "status")


def test_a_dvc_yaml_listing_a_whole_block_covers_its_keys(tmp_path):
    """A dvc.yaml written before the budgets moved to quantize lists `prune.gate` whole: still complete."""
    doc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    params = doc["stages"]["prune"]["params"]
    params[params.index("prune.gate.min_speedup")] = "prune.gate"
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(doc))
    assert check_dvc_yaml(ROOT, dvc_yaml=tmp_path / "dvc.yaml") == []
    params.remove("prune.gate")
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump(doc))
    assert check_dvc_yaml(ROOT, dvc_yaml=tmp_path / "dvc.yaml") == [
        "stage prune: does not list param prune.gate.min_speedup"
    ]
