"""The quality budget at its default: a pruned model outside it against dense never ships, the figures say why.

A small CNN on digits, whose batch-1 latency is mostly fixed cost, cut to a quarter of its
channels with no recovery (no fine-tuning between steps, none after) loses several points, as the
MobileNet-style CNN of the one-pipeline issue did at the default latency target (2.12x faster,
4.73 points below dense). At the default `prune.gate.max_accuracy_drop` the quantize stage backs
off to dense and says so; with the budget switched off the same pruned model ships.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from pruneops.config import PruneConfig
from pruneops.core.io import Layout, read_json
from pruneops.core.quality import QualityBudget, QualityChange
from pruneops.pipeline.runner import run_stage
from tests.conftest import tiny_params, write_params

UNTIL_FINETUNE = ("validate", "train", "sensitivity", "latency", "prune", "finetune")


def _params(**gate) -> dict:
    params = tiny_params()
    params["prune"].update(
        target={"kind": "ratio", "value": 0.75, "batch": None, "reference": None, "form": "fp32"},
        gate={"min_speedup": None, **gate},  # the default quality budget unless one is given
        epochs_per_step=0,
    )
    params["finetune"]["epochs"] = 0
    return params


@pytest.fixture(scope="module")
def cut_without_recovery(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("budget")
    write_params(root, _params())
    for stage in UNTIL_FINETUNE:
        run_stage(stage, root / "params.yaml", root)
    return root


def test_the_default_budget_backs_off_to_dense_and_says_why(cut_without_recovery):
    root = cut_without_recovery
    default = PruneConfig().gate
    assert default.max_accuracy_drop == 1.0  # the default the test is about
    budget = QualityBudget(default.max_accuracy_drop, "points")
    report = run_stage("quantize", root / "params.yaml", root)
    pruned = {n: c for n, c in report.candidates.items() if n.startswith("pruned ") and c["val_change"]}
    assert pruned and all(not budget.holds(QualityChange(**c["val_change"])) for c in pruned.values())
    assert min(-c["val_change"]["value"] for c in pruned.values()) > 1.0  # several points lost, not noise
    assert report.source == "dense"
    assert budget.holds(QualityChange(**report.val_change))
    assert any("max_accuracy_drop" in w and "dense model ships" in w for w in report.warnings)
    for stage in ("export", "benchmark"):
        run_stage(stage, root / "params.yaml", root)
    bench = read_json(Layout(root).metrics("benchmark"))
    assert bench["source"] == "dense" and bench["shipped"].startswith("dense ")
    # What ships is dense in some form: its test accuracy is dense's within the form's own cost.
    assert bench["quality_change"]["value"] > -1.0


def test_without_a_budget_the_same_pruned_model_ships(cut_without_recovery, tmp_path):
    root = cut_without_recovery
    write_params(tmp_path, _params(max_accuracy_drop=None))
    report = run_stage("quantize", tmp_path / "params.yaml", root)
    assert report.source == "pruned" and report.budget == "none"
    assert -report.val_change["value"] > 1.0  # the loss the default budget refused


def test_a_decoder_row_names_its_changes_beyond_its_corpus_where_measured():
    from pruneops.core.quality import beyond_corpus

    general = QualityChange(2.392, 2.12, 2.673, "perplexity", 160)
    zero_shot = QualityChange(-9.0, -16.5, -1.0, "points", 200)
    row = {"general_change": general.record(), "zero_shot_change": zero_shot.record()}
    assert beyond_corpus(row) == "; general text +239.2 % [+212.0, +267.3]; zero-shot -9.00 pts [-16.50, -1.00]"
    assert beyond_corpus({"general_change": general.record(), "zero_shot_change": None}) == (
        "; general text +239.2 % [+212.0, +267.3]"
    )
    assert beyond_corpus({}) == ""
