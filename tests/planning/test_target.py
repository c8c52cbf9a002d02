"""The target resolved once, in one module: the loaded config is never rewritten, the report records both."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import pruneops
from pruneops.core.io import read_json
from pruneops.core.params import read_params
from pruneops.pipeline.runner import run_stage
from pruneops.pipeline.stages import load_configs
from tests.planning.latency_cases import _stage_copy

PACKAGE = Path(pruneops.__file__).parent


def _calls(name: str) -> list[str]:
    """`module:line` of every call of `name` (a function or a method) in the package."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                callee = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
                if callee == name:
                    found.append(f"{path.relative_to(PACKAGE.parent).as_posix()}:{node.lineno}")
    return found


def test_the_target_is_made_in_one_module_and_no_config_is_rewritten_in_flight():
    made = {where.split(":")[0] for where in _calls("ResolvedTarget")}
    assert made == {"pruneops/planning/target.py"}, made
    assert _calls("with_target") == []  # the config's copy-with-another-target helper: tests and benches only


def test_the_prune_report_records_the_config_as_loaded_and_the_target_as_resolved(pipeline_dir, tmp_path):
    reference = pipeline_dir / "artifacts/export/pruned_fp32.onnx"
    prune = {"target": {"kind": "latency_ratio", "value": 1.0, "reference": str(reference)}, "trials": {"count": 1}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune)
    run_stage("latency", params, tmp_path)
    run_stage("prune", params, tmp_path)
    metrics = read_json(tmp_path / "metrics/prune.json")
    loaded = load_configs(read_params(params))["prune"]
    assert metrics["loaded_config"] == loaded.model_dump(mode="json")  # nothing rewritten
    assert metrics["loaded_config"]["target"]["value"] == 1.0  # of the reference, as set
    resolved = metrics["resolved_target"]
    assert resolved["asked"] == 1.0 and resolved["reference"] == str(reference.resolve())
    assert resolved["value"] == pytest.approx(metrics["reference"]["planned_ratio_of_dense"])  # of dense
    assert resolved["provenance"]["reference"]["file"] == str(reference.resolve())
