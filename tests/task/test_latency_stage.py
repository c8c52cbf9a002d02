"""The latency stage, and the prune stage's latency paths end to end on the session pipeline."""

from __future__ import annotations

import pytest

from pruneops.models import ModelSpec, create_model
from pruneops.planning.latency_model import PREDICTORS
from tests.planning.latency_cases import _renamed_or_fixed, _stage_copy


def test_the_latency_stage_times_nothing_without_a_latency_target_and_says_why(pipeline_dir):
    from pruneops.core.io import read_json

    # The session pipeline prunes to a ratio.
    metrics = read_json(pipeline_dir / "metrics/latency.json")
    assert metrics["measured"] is False and metrics["reason"] == "prune.target.kind is ratio, not a latency target"
    assert metrics["units"] == 0 and metrics["exports"] == 0
    assert not (pipeline_dir / "artifacts/latency/forms.json").exists() and metrics["forms"] == []
    assert "prune.target.kind is ratio" in (pipeline_dir / "artifacts/latency/skipped.txt").read_text()
    assert (pipeline_dir / "plots/latency/latency.png").stat().st_size > 0


@pytest.mark.slow
def test_the_latency_stage_times_every_swept_unit_in_the_configured_form(pipeline_dir, tmp_path):
    from PIL import Image

    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage

    # Half of dense: out of this tiny model's reach (its fastest plans read about 0.8 of dense, fixed
    # cost), however the machine's load moves its table; 0.8 was borderline (a shortlist on a loaded machine).
    prune = {"target": {"kind": "latency_ratio", "value": 0.5, "form": "static"}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune)
    report = run_stage("latency", params, tmp_path)
    sweep = read_json(tmp_path / "artifacts/sensitivity/sensitivity.json")
    saved = read_json(tmp_path / "artifacts/latency/static/latency.json")
    assert report.measured and report.forms == ("static",) and report.batches == (1, 8)  # 1 and every benchmark batch
    assert read_json(tmp_path / "artifacts/latency/forms.json")["planned"] == ["static"]
    assert set(saved["units"]) == set(sweep["units"]) and report.units == len(sweep["units"]) > 0
    assert saved["form"] == "static" and set(saved["layer_costs"]) | set(saved["calibration"]) >= {"1", "8"}
    # Dense, four uniform cuts and up to `unit_points` widths per unit alone (twins share theirs).
    assert 5 < report.exports <= 5 + 4 * report.units
    assert read_json(tmp_path / "metrics/latency.json")["measured"] is True
    # Each batch's predictor is the one with the least mean held-out miss, and the stage says which.
    for batch, choice in read_json(tmp_path / "metrics/latency.json")["predictors"]["static"].items():
        mean = choice["mean_held_out_error"]
        assert set(mean) == set(PREDICTORS) and mean[choice["predictor"]] == min(mean.values()), mean
        assert saved["mean_held_out_error"][batch] == mean
        assert f"static b{batch} {choice['predictor']}" in report.summary()
    assert min(Image.open(tmp_path / "plots/latency/latency.png").size) > 300
    # The prune stage plans on this table: in its form, within the gate's measurements.
    run_stage("prune", params, tmp_path)
    metrics = read_json(tmp_path / "metrics/prune.json")
    assert metrics["predicted_latency_ms"] is not None
    # Every plan the loop measured is in the metrics; the kept one is what the stage reports.
    (kept,) = [p for p in metrics["latency_plans"] if p["kept"]]
    # (The widths the table predicted: the kept ones' own time where the gate rounded them up.)
    assert kept.get("planned_ms", kept["measured_ms"]) == metrics["measured_latency_ms"]
    assert kept["predicted_ms"] == pytest.approx(metrics["predicted_latency_ms"])
    # This tiny model cannot reach the target: no plan is feasible, so there is no shortlist to try.
    assert metrics["plan_trials"] is None and any("not reached" in w for w in metrics["warnings"])


@pytest.mark.slow
def test_auto_times_every_form_the_quantize_stage_may_ship_and_prunes_in_the_one_kept(pipeline_dir, tmp_path):
    from PIL import Image

    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage

    prune = {"target": {"kind": "latency_ratio", "value": 0.8, "form": "auto"}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune, quantize={"method": "static"})
    report = run_stage("latency", params, tmp_path)
    # quantize.method static ships static INT8 whatever it measures: fp32 is timed as the reference only.
    assert report.forms == ("fp32", "static") and report.form == "auto"
    forms = read_json(tmp_path / "artifacts/latency/forms.json")
    assert forms == {"setting": "auto", "planned": ["static"], "reference": "fp32", "screened": {}}
    assert read_json(tmp_path / "artifacts/latency/fp32/latency.json")["form"] == "fp32"
    width, height = Image.open(tmp_path / "plots/latency/latency.png").size
    assert height > width  # a panel per form, stacked (one alone is wider than high)
    run_stage("prune", params, tmp_path)
    metrics = read_json(tmp_path / "metrics/prune.json")
    assert metrics["latency_form"] == "static" and metrics["target_value"] == 0.8  # the target as set
    (choice,) = metrics["form_choice"]
    assert choice["form"] == "static" and choice["chosen"] and choice["target_value"] != 0.8  # of dense static
    assert read_json(tmp_path / "artifacts/prune/allocation.json")["latency_form"] == "static"


@pytest.mark.slow
def test_auto_with_quantize_auto_leaves_untimed_only_the_forms_it_measured_slower_than_fp32(pipeline_dir, tmp_path):
    import re

    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage
    from pruneops.planning.forms import SCREEN_MARGIN

    prune = {"target": {"kind": "latency_ratio", "value": 0.8, "form": "auto"}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune, quantize={"method": "auto"})
    report = run_stage("latency", params, tmp_path)
    # Every form the quantize stage may ship is either timed or screened out, fp32 always timed.
    assert "fp32" in report.forms and set(report.forms) | set(report.screened) == {"fp32", "static", "dynamic"}
    assert not set(report.forms) & set(report.screened)
    forms = read_json(tmp_path / "artifacts/latency/forms.json")
    assert forms["planned"] == list(report.forms) and forms["screened"] == report.screened
    assert sorted(p.parent.name for p in (tmp_path / "artifacts/latency").glob("*/latency.json")) == list(report.forms)
    for form, why in report.screened.items():
        # Each reason shows the form's ms against fp32's at each point and batch, all slower by the margin.
        pairs = re.findall(r"(dense|quarter) ([\d.e+-]+) vs ([\d.e+-]+) ms at batch (\d+)", why)
        assert {(p, int(b)) for p, _, _, b in pairs} == {(p, b) for p in ("dense", "quarter") for b in report.batches}
        assert all(float(ms) > SCREEN_MARGIN * float(ref) * 0.99 for _, ms, ref, _ in pairs), (form, why)
    run_stage("prune", params, tmp_path)
    choices = read_json(tmp_path / "metrics/prune.json")["form_choice"]
    assert [c["form"] for c in choices] == [*report.forms, *report.screened]
    assert [c["screened"] for c in choices if "screened" in c] == list(report.screened.values())
    assert sum(c["chosen"] for c in choices) == 1 and not any(c["chosen"] for c in choices if "screened" in c)


def test_a_latency_target_relative_to_a_reference_model_holds_each_plan_to_the_reference_read_in_its_run(
    pipeline_dir, tmp_path
):
    """`prune.target.reference`: the reference is timed at the start (the plan's ratio of dense) and
    again in every gate reading beside dense and the plan, and each plan is held to that reading."""
    from pruneops.core.io import read_json
    from pruneops.pipeline.runner import run_stage

    reference = pipeline_dir / "artifacts/export/pruned_fp32.onnx"  # the session pipeline's half-ratio cut
    prune = {"target": {"kind": "latency_ratio", "value": 1.0, "reference": str(reference)}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune | {"trials": {"count": 1}})
    run_stage("latency", params, tmp_path)
    run_stage("prune", params, tmp_path)
    metrics = read_json(tmp_path / "metrics/prune.json")
    record = metrics["reference"]
    assert record["file"] == str(reference.resolve()) and len(record["sha256"]) == 64
    start = record["ms_at_start"] / record["dense_ms_at_start"]
    assert record["planned_ratio_of_dense"] == pytest.approx(min(start, 1.0))  # min_speedup null: at most dense
    assert metrics["target_value"] == 1.0  # the target as set: of the reference
    assert metrics["latency_plans"]
    for plan in metrics["latency_plans"]:
        # Held to the reference as timed in the plan's own run, not to the ratio read at the start.
        goal = min(plan["reference_ms"], plan["dense_ms"])
        assert plan["fraction_of_target"] == pytest.approx(plan["measured_ms"] / goal)
    assert record["ms"]["1"] == next(p["reference_ms"] for p in metrics["latency_plans"] if p["kept"])
    speedup = record["speedups_over_reference"]["1"]
    assert speedup == pytest.approx(record["ms"]["1"] / metrics["measured_ms"]["1"])


def test_a_reference_model_that_cannot_be_timed_on_the_models_inputs_is_refused_with_why(pipeline_dir, tmp_path):
    from pruneops.config import BenchmarkConfig
    from pruneops.core.errors import ConfigError
    from pruneops.runtimes.onnxruntime.timing import measured_latency

    source = pipeline_dir / "artifacts/export/pruned_fp32.onnx"
    model = create_model(ModelSpec("cnn", [1, 8, 8], 10, {"widths": [16, 32]})).eval()
    timing = BenchmarkConfig(threads=1, batch_sizes=[1], warmup=1, repeats=2, rounds=1)

    def timed(path):
        return measured_latency({"dense": model, "reference": path}, [1, 8, 8], timing)

    assert set(timed(source)) == {"dense", "reference"}
    with pytest.raises(ConfigError, match="target.reference: .*missing.onnx not found"):
        timed(tmp_path / "missing.onnx")
    (tmp_path / "text.onnx").write_text("not a model")
    with pytest.raises(ConfigError, match="text.onnx is not an ONNX model ONNX Runtime loads"):
        timed(tmp_path / "text.onnx")
    with pytest.raises(ConfigError, match="takes inputs pixels; the model's export takes input"):
        timed(_renamed_or_fixed(source, tmp_path / "renamed.onnx", rename="pixels"))
    with pytest.raises(ConfigError, match=r"fixed batch size in input \(1\); .* dynamic batch axis"):
        timed(_renamed_or_fixed(source, tmp_path / "fixed.onnx", batch=1))


def test_the_latency_stage_refuses_a_sweep_of_another_model(pipeline_dir, tmp_path):
    import json

    from pruneops.core.errors import DataError
    from pruneops.pipeline.runner import run_stage

    prune = {"target": {"kind": "latency_ratio", "value": 0.8}}
    params = _stage_copy(pipeline_dir, tmp_path, prune=prune)
    path = tmp_path / "artifacts/sensitivity/sensitivity.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), "model_sha256": "0" * 64}))
    with pytest.raises(DataError, match="swept another model than .*model.safetensors; rerun `pruneops sensitivity`"):
        run_stage("latency", params, tmp_path)
    assert not (tmp_path / "artifacts/latency").exists()
