"""Targets, forms and the gate: measured latency decides, in the form that ships."""

from __future__ import annotations

import copy
from unittest.mock import ANY

import pytest
import torch

from pruneops.models import ModelSpec, create_model
from pruneops.planning import loop as loop_module
from pruneops.planning import targets as targets_module
from pruneops.planning.latency_model import LatencyModel
from tests.planning.latency_cases import CNN_SWEEP, DECISIONS, SHAPE, _fake_times, _save_tables, _sweep, _units


@pytest.mark.parametrize(
    ("factors", "decision", "timed", "widen"),
    [
        ({"plan0": (0.5, 0.6), "plan1": (0.6, 0.7)}, "passed", "plan0", True),
        # Rounded up: faster at batch 1 but slower at 64, so not "no slower": the planned widths.
        ({"plan0": (0.5, 0.6), "plan1": (0.45, 0.7)}, "passed", "plan0", True),
        ({"plan0": (0.5, 0.6), "plan1": (0.45, 0.55)}, "passed: widths rounded up", "plan1", True),
        # A MAC, parameter or ratio budget: wider widths would break it, however fast they run.
        ({"plan0": (0.5, 0.6), "plan1": (0.45, 0.55)}, "passed", "plan0", False),
        ({"plan0": (0.99, 0.7), "plan1": (0.9, 0.8)}, "backed off: widths rounded up", "plan1", True),
        ({"plan0": (0.99, 0.7), "plan1": (0.9, 0.8)}, "backed off: widths rounded up", "plan1", False),
        ({"plan0": (0.5, 1.2), "plan1": (0.6, 1.1)}, "refused", "plan0", True),  # faster at batch 1, slower at 64
        ({"plan0": (1.3, 1.0), "plan1": (1.1, 1.0)}, "refused", "plan0", True),
    ],
)
def test_the_gate_passes_rounds_up_backs_off_or_refuses_on_measured_latency(
    monkeypatch, factors, decision, timed, widen
):
    from pruneops.config import BenchmarkConfig

    monkeypatch.setattr(targets_module, "measured_latency", _fake_times(factors))
    model = create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [32, 64]})).eval()
    example = torch.zeros(1, *SHAPE)
    sizes = _units(model, example)
    ratios = {n: 0.3 for n in sizes}  # 32 -> 22 channels: not a multiple of 16, so a rounded-up plan exists
    timing = BenchmarkConfig(batch_sizes=[1, 64])
    result = targets_module.gate(model, example, SHAPE, ratios, sizes, 1.05, timing, widen_when_free=widen)
    assert result.text.startswith(decision) and ("(no slower)" in result.text) == (
        decision == "passed: widths rounded up"
    )
    assert result.decision is DECISIONS[decision]
    if decision.startswith(("backed off", "refused")):  # what the planned widths measured, and against what
        speedups = f"{1 / factors['plan0'][0]:.2f}x at batch 1 and {1 / factors['plan0'][1]:.2f}x at batch 64"
        assert f"the planned widths measured {speedups}" in result.text and "< 1.05x" in result.text
    assert (result.ratios is not None) == (decision != "refused")
    # Times and speed-ups are those of the widths kept (as planned when refused); the planned
    # widths' own times are kept for the table's prediction error.
    assert result.measured_ms == {"1": pytest.approx(factors[timed][0]), "64": pytest.approx(factors[timed][1])}
    assert result.speedups == {"1": pytest.approx(1 / factors[timed][0]), "64": pytest.approx(1 / factors[timed][1])}
    assert result.planned_ms == {"1": pytest.approx(factors["plan0"][0]), "64": pytest.approx(factors["plan0"][1])}
    kept = {n: round((1 - r) * sizes[n]) for n, r in (result.ratios or {}).items()}
    if timed == "plan1":
        assert kept and all(w % 16 == 0 for w in kept.values())
    elif kept:
        assert kept == {n: round(0.7 * s) for n, s in sizes.items()}


def test_a_mac_target_is_not_widened_past_its_budget_by_rounded_widths_that_run_no_slower(
    pipeline_dir, tmp_path, monkeypatch
):
    """Found on the ConvNeXt-style workload (2026-11-27): a MAC target at Torch-Pruning's 2.18 M MACs
    shipped 3.10 M, the gate having taken the rounded-up widths because they ran no slower."""
    import shutil

    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage
    from tests.conftest import tiny_params, write_params

    for stage in ("validate", "train", "sensitivity"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, tmp_path / "artifacts" / stage)
    budget = 0.4 * read_json(pipeline_dir / "metrics/train.json")["macs"]
    # The rounded-up widths run faster than the planned ones at both batch sizes: free, in milliseconds.
    monkeypatch.setattr(targets_module, "measured_latency", _fake_times({"plan0": (0.5, 0.6), "plan1": (0.45, 0.55)}))
    prune = {
        "target": {"kind": "macs", "value": budget},
        "gate": {"min_speedup": 1.05},
        "schedule": "oneshot",
        "steps": 1,
    }
    run_stage("prune", write_params(tmp_path, tiny_params(prune=prune | {"epochs_per_step": 0})), tmp_path)
    report = read_json(tmp_path / "metrics/prune.json")
    assert report["gate"] == "passed" and report["macs"] <= budget, (report["gate"], report["macs"], budget)


@pytest.mark.parametrize(
    ("target", "value", "widen"),
    [
        ("latency_ratio", 0.5, True),
        ("latency_ms", 0.1, True),
        ("macs", 1e6, False),
        ("params", 1e4, False),
        ("ratio", 0.5, False),
    ],
)
def test_the_prune_stage_lets_the_gate_widen_for_latency_targets_only(monkeypatch, target, value, widen):
    from pruneops.config import BenchmarkConfig, PruneConfig
    from pruneops.planning.targets import Plan

    seen = []

    def gate(*args, **kwargs):
        seen.append(args[8])  # widen_when_free
        return targets_module.GateResult(targets_module.GateDecision.PASSED, args[3], {}, {}, {})

    monkeypatch.setattr(targets_module, "gate", gate)
    model = create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [32, 64]})).eval()
    config = PruneConfig(target={"kind": target, "value": value})
    loop_module.gate_plan(config, BenchmarkConfig(batch_sizes=[1]), model, torch.zeros(1, *SHAPE), SHAPE, Plan(0.3))
    assert seen == [widen]


def test_the_gate_never_rounds_a_head_count_to_channel_blocks():
    heads = {"encoder.0.heads": 6, "encoder.0.mlp": 22}
    assert targets_module._rounded(heads, {"encoder.0.heads": 12, "encoder.0.mlp": 64}) == {
        "encoder.0.heads": 6,
        "encoder.0.mlp": 32,
    }


@pytest.mark.parametrize("form", ["fp32", "static"])
def test_the_gate_times_the_form_that_will_ship(monkeypatch, form):
    from pruneops.config import BenchmarkConfig

    forms = []
    monkeypatch.setattr(targets_module, "measured_latency", _fake_times({"plan0": (0.5, 0.5)}, forms))
    model = create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [32, 64]})).eval()
    example = torch.zeros(1, *SHAPE)
    sizes = _units(model, example)
    ratios = {n: 0.5 for n in sizes}  # whole blocks of 16: no back-off step
    targets_module.gate(model, example, SHAPE, ratios, sizes, 1.05, BenchmarkConfig(batch_sizes=[1]), form)
    assert forms == [form]


def test_a_latency_target_refuses_a_table_timed_in_another_form(synthetic, tmp_path):
    from pruneops.config import PruneConfig
    from pruneops.core.errors import ConfigError
    from pruneops.planning.targets import plan_latency

    latency, sizes = synthetic
    latency.calibration[1] = (0.0, 1.0)
    latency.form = "static"
    saved = latency.to_json()
    assert LatencyModel.from_json(saved, latency.table).form == "static"
    _save_tables(tmp_path, latency)
    sweep = _sweep(sizes, lambda n: [0.0, 0.01, 0.02])
    config = PruneConfig(target={"kind": "latency_ratio", "value": 0.5}, max_unit_ratio=0.8)
    with pytest.raises(ConfigError, match=r"prune.target.form: fp32, but the latency table was timed in static; rerun"):
        plan_latency(config, sweep, tmp_path, 1)
    planned = plan_latency(config.with_target(form="static"), sweep, tmp_path, 1)
    assert planned.predicted_ms <= 0.5 * planned.dense_predicted_ms * 1.001


def test_a_target_in_ms_that_dense_already_meets_is_refused_and_one_below_it_is_planned(synthetic, tmp_path):
    from pruneops.config import PruneConfig
    from pruneops.core.errors import ConfigError
    from pruneops.planning.targets import plan

    latency, sizes = synthetic
    latency.calibration[1] = (0.0, 1.0)
    _save_tables(tmp_path, latency)
    sweep = _sweep(sizes, lambda n: [0.0, 0.01, 0.02])
    dense = latency.predict({}, 1)
    config = PruneConfig(target={"kind": "latency_ms", "value": dense, "batch": 1}, max_unit_ratio=0.8)
    with pytest.raises(ConfigError, match=r"^prune.target.value: .* ms is not below the dense model's .*already meets"):
        plan(config, sweep, None, None, list(SHAPE), tmp_path, 1)
    below = plan(config.with_target(value=0.7 * dense), sweep, None, None, list(SHAPE), tmp_path, 1)
    assert below.dense_predicted_ms == pytest.approx(dense) and below.predicted_ms <= 0.7 * dense * 1.001


def test_a_latency_plan_is_the_one_the_trials_choose_from_the_shortlist(synthetic, tmp_path):
    from pruneops.config import PruneConfig, TrialsConfig
    from pruneops.planning.targets import plan_latency

    latency, sizes = synthetic
    latency.calibration[1] = (0.0, 1.0)
    _save_tables(tmp_path, latency)
    ratios = [0.25, 0.5, 0.75, 0.875, 0.9375]
    units = {n: {"ratios": ratios, "accuracy_drop": CNN_SWEEP[n], "size": s} for n, s in sizes.items()}
    sweep = {"units": units, "weights": dict.fromkeys(sizes, 1.0)}
    config = PruneConfig(target={"kind": "latency_ratio", "value": 0.5}, max_unit_ratio=0.94)
    offered = []

    def last(options):
        offered.append(options)
        return len(options) - 1

    untried = plan_latency(config, sweep, tmp_path, 1)
    tried = plan_latency(config, sweep, tmp_path, 1, choose=last)
    (options,) = offered
    assert 2 <= len(options) <= config.trial_count == 4 and options[0].ratios == untried.ratios
    assert tried.ratios == options[-1].ratios != untried.ratios
    assert (tried.predicted_ms, tried.summed_drop) == (options[-1].predicted_ms, options[-1].summed_isolated_drop)
    # One plan asked for: nothing to choose between, no trial.
    plan_latency(config.model_copy(update={"trials": TrialsConfig(count=1)}), sweep, tmp_path, 1, choose=last)
    assert len(offered) == 1


@pytest.mark.parametrize(("int8_speed", "kept"), [(2.0, "static"), (1 / 1.5, "fp32")])
def test_auto_plans_a_latency_ratio_of_dense_fp32_in_every_form_and_keeps_the_cheapest(
    synthetic, tmp_path, int8_speed, kept
):
    """`prune.target.form: auto`: the same milliseconds need fewer cuts where INT8 is faster dense.

    Static INT8 runs the dense model `int8_speed` times faster than fp32: asked for half of dense
    fp32, it needs no cut at 2x (so the plan is only as deep as the gate's 1.05x asks of any pruned
    model, at a far smaller summed drop) and deeper cuts than fp32 where it is slower.
    """

    from pruneops.config import PruneConfig
    from pruneops.planning.targets import choose_latency_form, plan_latency

    latency, sizes = synthetic
    latency.calibration[1] = (0.0, 1.0)
    static = copy.deepcopy(latency)
    static.form, static.calibration[1] = "static", (0.0, 1.0 / int8_speed)
    _save_tables(tmp_path, latency, static)
    sweep = _sweep(sizes, lambda n: [0.0, 0.01, 0.05])
    config = PruneConfig(target={"kind": "latency_ratio", "value": 0.5, "form": "auto"})
    chosen, choices = choose_latency_form(config, sweep, tmp_path, 1)
    by_form = {c["form"]: c for c in choices}
    assert chosen.form == kept and [c["form"] for c in choices if c["chosen"]] == [kept]  # the target resolved
    fp32 = plan_latency(config.with_target(form="fp32"), sweep, tmp_path, 1)
    assert by_form["fp32"]["target_value"] == 0.5 and by_form["fp32"]["summed_drop"] == fp32.summed_drop
    # The same milliseconds in each form (up to the gate's floor): half of dense fp32.
    expected = min(0.5 * int8_speed, 1 / 1.05)
    assert by_form["static"]["target_value"] == pytest.approx(expected) and chosen.value == pytest.approx(
        by_form[kept]["target_value"]
    )
    assert by_form["static"]["target_ms"] == pytest.approx(expected * latency.predict({}, 1) / int8_speed)
    other = by_form["fp32" if kept == "static" else "static"]
    assert by_form[kept]["summed_drop"] < other["summed_drop"]
    # A target in milliseconds is the same in every form.
    in_ms = config.with_target(kind="latency_ms", value=0.6 * latency.predict({}, 1))
    _, choices = choose_latency_form(in_ms, sweep, tmp_path, 1)
    assert {c["target_value"] for c in choices} == {in_ms.target.value}


def test_a_form_is_screened_out_only_where_it_is_slower_than_fp32_everywhere_by_the_margin():
    from pruneops.planning.forms import SCREEN_MARGIN, forms_slower_than_fp32

    fp32 = {"dense": {1: 1.0, 64: 20.0}, "quarter": {1: 0.3, 64: 5.0}}

    def scaled(dense: float, quarter: float) -> dict:
        factor = {"dense": dense, "quarter": quarter}
        return {p: {b: factor[p] * ms for b, ms in per.items()} for p, per in fp32.items()}

    medians = {
        "fp32": fp32,
        "dynamic": scaled(6.0, 3.0),  # convolutions in dynamic INT8 on AVX2: slower everywhere
        "static": scaled(0.5, 1.4),  # faster dense, slower cut deep: still worth a table
        "close": scaled(SCREEN_MARGIN * 0.98, SCREEN_MARGIN * 0.98),  # slower, within the margin
    }
    out = forms_slower_than_fp32(medians)
    assert set(out) == {"dynamic"}
    assert "dense 6 vs 1 ms at batch 1" in out["dynamic"] and "quarter 15 vs 5 ms at batch 64" in out["dynamic"]
    assert forms_slower_than_fp32(medians, margin=1.0) == {"dynamic": out["dynamic"], "close": ANY}
