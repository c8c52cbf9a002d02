"""Each stage's outputs, from one tiny run of the whole pipeline on digits (conftest)."""

import json

import numpy as np
import onnx
import pytest
import torch
from PIL import Image

from pruneops.core.io import read_json
from pruneops.models.checkpoint import load_checkpoint
from pruneops.task.classification.quantize import SAME_SPEED


def _metrics(root, stage):
    return read_json(root / "metrics" / f"{stage}.json")


def test_train_stage_writes_safetensors_and_metrics(pipeline_dir):
    m = _metrics(pipeline_dir, "train")
    assert m["test_accuracy"] > 0.8
    assert m["params"] > 0 and m["macs"] > m["params"]
    ckpt = load_checkpoint(pipeline_dir / "artifacts/train/model.safetensors")
    assert ckpt.spec.name == "cnn"
    assert not list((pipeline_dir / "artifacts/train").glob("*.pt"))


def test_sensitivity_curves_and_the_prune_stages_allocation(pipeline_dir):
    sens = read_json(pipeline_dir / "artifacts/sensitivity/sensitivity.json")
    alloc = read_json(pipeline_dir / "artifacts/prune/allocation.json")
    assert set(alloc["ratios"]) == set(sens["units"]) == set(sens["weights"])
    assert alloc["achieved_ratio"] >= alloc["target_ratio"] - 1e-9
    assert (pipeline_dir / "plots/prune/allocation.png").stat().st_size > 10_000
    for curve in sens["units"].values():
        assert curve["ratios"] == sorted(curve["ratios"]) and len(curve["ratios"]) == len(curve["accuracy_drop"])
    png = Image.open(pipeline_dir / "plots/sensitivity/sensitivity.png")
    assert png.size[0] > 400


def test_prune_stage_history_and_real_shrink(pipeline_dir):
    m = _metrics(pipeline_dir, "prune")
    history = read_json(pipeline_dir / "plots/prune/history.json")
    assert [h["step"] for h in history] == [0, 1, 2]
    assert history[-1]["macs"] < history[1]["macs"] < history[0]["macs"]
    assert m["mac_reduction"] >= 2.0
    assert m["weight_zero_fraction"] == 0.0
    assert (pipeline_dir / "plots/prune/history.png").stat().st_size > 10_000


def test_finetune_stage_keeps_accuracy_close(pipeline_dir):
    m = _metrics(pipeline_dir, "finetune")
    assert m["test_accuracy"] > 0.8
    assert m["accuracy_delta_points"] == pytest.approx(100 * (m["test_accuracy"] - m["baseline_test_accuracy"]))


def test_quantize_stage_keeps_the_fastest_candidate_with_fp32_among_them(pipeline_dir):
    m = _metrics(pipeline_dir, "quantize")
    assert set(m["candidates"]) == {"static", "dynamic", "fp32"}
    fp32 = m["candidates"]["fp32"]
    chosen = m["candidates"][m["method"]]
    assert set(chosen["latency_ms"]) == {"1", "8"}  # batch 1 and every benchmark batch size
    assert chosen["within_tolerance"] and fp32["within_tolerance"]
    # Never slower than fp32 (beyond a tie) at a benchmark batch size; of those that are not, the
    # fastest at batch 1, ties there going to the fastest at the largest batch.
    tie = 1 + SAME_SPEED
    assert all(chosen["latency_ms"][b] <= tie * fp32["latency_ms"][b] for b in fp32["latency_ms"])
    not_slower = [
        c
        for c in m["candidates"].values()
        if c["within_tolerance"] and all(c["latency_ms"][b] <= tie * fp32["latency_ms"][b] for b in fp32["latency_ms"])
    ]
    best = min(c["latency_ms_b1"] for c in not_slower)
    assert chosen["latency_ms_b1"] <= tie * best
    tied = [c for c in not_slower if c["latency_ms_b1"] <= tie * best]
    assert all(chosen["latency_ms"]["8"] <= c["latency_ms"]["8"] for c in tied)
    assert m["warnings"] == []
    assert abs(m["test_accuracy"] - m["fp32_test_accuracy"]) < 0.05
    model = onnx.load(pipeline_dir / "artifacts/quantize/model.onnx")
    quantized = any(n.op_type in ("QuantizeLinear", "DynamicQuantizeLinear", "MatMulInteger") for n in model.graph.node)
    assert quantized == (m["precision"] == "int8") and m["precision"] == chosen["precision"]


def test_export_stage_dynamic_batch_parity_and_tensorrt_note(pipeline_dir):
    m = _metrics(pipeline_dir, "export")
    assert m["dense_max_abs_diff"] < 1e-4 and m["pruned_max_abs_diff"] < 1e-4
    assert m["tensorrt"].startswith(("skipped — ", "built"))
    model = onnx.load(pipeline_dir / "artifacts/export/pruned_fp32.onnx")
    dim = model.graph.input[0].type.tensor_type.shape.dim[0]
    assert dim.dim_param and not dim.dim_value


def test_benchmark_stage_reports_every_model(pipeline_dir):
    m = _metrics(pipeline_dir, "benchmark")
    assert set(m["models"]) == {"dense_fp32", "pruned_fp32", "pruned_deployed"}
    for model in m["models"].values():
        for b in ("1", "8"):
            lat = model["latency"][b]
            assert 0 < lat["p50_ms"] <= lat["p95_ms"] <= lat["p99_ms"]
            assert lat["throughput"] == pytest.approx(int(b) / (lat["mean_ms"] / 1e3))
    dense = m["models"]["dense_fp32"]
    deployed = m["models"]["pruned_deployed"]
    assert m["speedup_b1_deployed_vs_dense"] == pytest.approx(
        dense["latency"]["1"]["p50_ms"] / deployed["latency"]["1"]["p50_ms"]
    )
    assert deployed["size_bytes"] < dense["size_bytes"]
    slower = [
        n
        for n, model in m["models"].items()
        if any(model["latency"][b]["p50_ms"] > dense["latency"][b]["p50_ms"] for b in ("1", "8"))
    ]
    assert m["slower_than_dense"] == slower
    table = (pipeline_dir / "artifacts/benchmark/benchmark.md").read_text()
    assert f"| pruned_deployed ({deployed['precision']}) |" in table
    assert np.isfinite(json.loads((pipeline_dir / "plots/benchmark/frontier.json").read_text())[0]["latency_b1_ms"])


def test_the_benchmark_says_a_gpu_here_was_not_timed(pipeline_dir, tmp_path, monkeypatch):
    import shutil

    import torch

    from pruneops.pipeline.runner import run_stage

    for stage in ("validate", "export"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, tmp_path / "artifacts" / stage)
    shutil.copy(pipeline_dir / "params.yaml", tmp_path / "params.yaml")
    # The session pipeline ran on this machine as it is: a warning only where it has a GPU.
    assert len(_metrics(pipeline_dir, "benchmark")["warnings"]) == int(torch.cuda.is_available())
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *_: "Test GPU 80GB")
    report = run_stage("benchmark", tmp_path / "params.yaml", tmp_path)
    (warning,) = report.warning_lines
    assert warning.startswith("a CUDA device is here (Test GPU 80GB), but nothing in this pipeline ran on it")
    assert _metrics(tmp_path, "benchmark")["machine"]["cuda_device"] == "Test GPU 80GB"
    assert f"Warning: {warning}" in (tmp_path / "artifacts/benchmark/benchmark.md").read_text()


def test_prune_stage_recalibrates_batchnorm_after_each_step(pipeline_dir, tmp_path):
    import shutil

    import torch

    from pruneops.core.io import Layout
    from pruneops.data import load_prepared
    from pruneops.pipeline.runner import run_stage
    from pruneops.training.fit import calibration_subset, recalibrate_batchnorm_
    from tests.conftest import tiny_params, write_params

    models = {}
    for samples in (0, 256):
        root = tmp_path / str(samples)
        for stage in ("validate", "train", "sensitivity"):
            shutil.copytree(pipeline_dir / "artifacts" / stage, root / "artifacts" / stage)
        prune = {"schedule": "oneshot", "steps": 1, "epochs_per_step": 0, "bn_recalibration_samples": samples}
        run_stage("prune", write_params(root, tiny_params(prune=prune)), root)
        models[samples] = load_checkpoint(root / "artifacts/prune/model.safetensors").model
    # Same channels cut either way; only the BatchNorm buffers differ, and they are the data's.
    _, train, _, _ = load_prepared(Layout(tmp_path / "0").stage_dir("validate"))
    stale, fresh = models[0].state_dict(), models[256].state_dict()
    assert {k: v.shape for k, v in stale.items()} == {k: v.shape for k, v in fresh.items()}
    means = [k for k in stale if k.endswith("running_mean")]
    assert means and all(not torch.allclose(stale[k], fresh[k], atol=1e-3) for k in means)
    recalibrate_batchnorm_(models[0], calibration_subset(train.x, 256, 0))
    for key, value in models[0].state_dict().items():
        torch.testing.assert_close(value, fresh[key], atol=1e-5, rtol=1e-5)


def test_run_logged_keeps_the_last_non_blank_lines_for_the_error_message(tmp_path):
    """An experiment's failure message is the tail's last line: a trailing blank must not hide it."""
    import sys

    from pruneops.pipeline.experiments import run_logged

    seen: list[str] = []
    code, tail = run_logged(
        [sys.executable, "-c", "print('a'); print('ERROR: boom'); print(); print('  ')"], tmp_path, seen.append
    )
    assert code == 0 and tail == ["a", "ERROR: boom"] and len(seen) == 4


@pytest.mark.parametrize("weight", [0.0, 0.7])
def test_prune_steps_distil_from_the_unpruned_model_when_asked(pipeline_dir, tmp_path, monkeypatch, weight):
    import shutil

    import pruneops.planning.recipe as prune_module  # where the steps and their fine-tuning run
    from pruneops.pipeline.runner import run_stage
    from tests.conftest import tiny_params, write_params

    seen = []
    real_fit = prune_module.fit_

    def spy(model, *args, distillation=None, **kwargs):
        seen.append((distillation, sum(p.numel() for p in model.parameters())))
        return real_fit(model, *args, distillation=distillation, **kwargs)

    monkeypatch.setattr(prune_module, "fit_", spy)
    for stage in ("validate", "train", "sensitivity"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, tmp_path / "artifacts" / stage)
    prune = {"schedule": "linear", "steps": 2, "epochs_per_step": 1}
    prune |= {"distillation": {"weight": weight, "temperature": 3.0}}
    run_stage("prune", write_params(tmp_path, tiny_params(prune=prune)), tmp_path)
    baseline = load_checkpoint(tmp_path / "artifacts/train/model.safetensors").model
    assert len(seen) == 2
    if weight == 0.0:
        assert all(kd is None for kd, _ in seen)
        return
    for kd, student_params in seen:
        assert (kd.weight, kd.temperature) == (0.7, 3.0)
        # The teacher is the baseline as it was, while the student shrinks step by step.
        teacher = kd.teacher.state_dict()
        for key, value in baseline.state_dict().items():
            torch.testing.assert_close(teacher[key], value)
        assert student_params < sum(p.numel() for p in baseline.parameters())


def test_finetune_distils_while_the_student_is_below_the_teacher_by_default(pipeline_dir, tmp_path):
    import shutil

    from pruneops.data import load_prepared
    from pruneops.pipeline.runner import run_stage
    from pruneops.training.fit import evaluate
    from tests.conftest import tiny_params, write_params

    # A student that starts above its teacher: the session's fine-tuned model, taught by its own
    # pruned-but-not-fine-tuned self (same widths, lower accuracy).
    stages = {"validate": "validate", "train": "prune", "prune": "finetune"}
    histories = {}
    for schedule in ("every_epoch", None):
        work = tmp_path / str(schedule)
        for stage, source in stages.items():
            shutil.copytree(pipeline_dir / "artifacts" / source, work / "artifacts" / stage)
        finetune = {"epochs": 3, "patience": 3} | ({"distill_schedule": schedule} if schedule else {})
        run_stage("finetune", write_params(work, tiny_params(finetune=finetune)), work)
        histories[schedule] = read_json(work / "plots" / "finetune" / "history.json")
        distilled = sum(e["distilled"] for e in histories[schedule])
        assert _metrics(work, "finetune")["distilled_epochs"] == distilled
    assert [e["distilled"] for e in histories["every_epoch"]] == [True] * 3
    # The default (the last run, in `work`): each epoch distils exactly when it begins below the
    # teacher (the first from the student as loaded, the others from the epoch before); this
    # student begins above it.
    history = histories[None]
    flags = [e["distilled"] for e in history]
    val = load_prepared(work / "artifacts" / "validate")[2]
    teacher_val, student_val = (
        evaluate(load_checkpoint(work / "artifacts" / stage / "model.safetensors").model, val)[0]
        for stage in ("train", "prune")
    )
    assert student_val > teacher_val
    began = [student_val] + [e["val_accuracy"] for e in history[:-1]]
    assert flags == [acc < teacher_val for acc in began] and not flags[0]


def test_finetune_runs_the_teacher_of_augmented_batches_on_onnx_runtime_when_asked(pipeline_dir, tmp_path):
    import shutil

    from pruneops.pipeline.runner import run_stage
    from tests.conftest import tiny_params, write_params

    for stage in ("validate", "train", "prune"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, tmp_path / "artifacts" / stage)
    finetune = {"teacher_runtime": "onnxruntime", "augment": {"crop_padding": 1}, "distill_weight": 0.5}
    run_stage("finetune", write_params(tmp_path, tiny_params(finetune=finetune)), tmp_path)
    m, plain = _metrics(tmp_path, "finetune"), _metrics(pipeline_dir, "finetune")
    assert (m["teacher_runtime"], plain["teacher_runtime"]) == ("onnxruntime", "torch")
    # Same budget as the plain run, other (augmented) batches: recovery alike, far above chance.
    assert m["test_accuracy"] > 0.8
