"""`finetune` stage: recovery fine-tuning of the pruned model, distilled from the baseline."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pruneops.config import FinetuneConfig
from pruneops.core.inputs import head_tensors
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data import load_prepared
from pruneops.data.augment import check_augmentable
from pruneops.models.checkpoint import check_recorded_accuracy, load_checkpoint, save_checkpoint
from pruneops.models.profiling import count_macs, count_params
from pruneops.pipeline.stages import StageReport
from pruneops.pruning.masks import apply_masks_, load_masks, make_permanent_
from pruneops.pruning.report import sparsity_report
from pruneops.reports.plots import save_fit_history
from pruneops.training.distillation import Distillation
from pruneops.training.fit import FitResult, evaluate, fit_, fit_settings, onnx_forward, torchrun_group


@dataclass(frozen=True)
class FinetuneReport(StageReport):
    """The recovered model against the baseline."""

    params: int
    macs: int
    val_accuracy: float
    test_accuracy: float
    baseline_test_accuracy: float
    accuracy_delta_points: float
    mac_reduction: float
    weight_zero_fraction: float
    epochs_run: int
    world_size: int
    teacher_runtime: str  # where the teacher ran: onnxruntime, torch, or none (no distillation)
    distilled_epochs: int  # epochs run with the teacher's loss (`distill_schedule`)
    checkpoint: Path

    def summary(self) -> str:
        return (
            f"test accuracy {100 * self.test_accuracy:.2f}% ({self.accuracy_delta_points:+.2f} pts vs baseline), "
            f"{self.mac_reduction:.2f}x fewer MACs -> {self.checkpoint}"
        )


def finetune(config: FinetuneConfig, layout: Layout | None = None) -> FinetuneReport:
    """Fine-tunes the pruned model with distillation from the baseline, keeping its sparsity.

    Under torchrun (`finetune.nproc_per_node` x `finetune.nnodes` > 1, launched by the CLI) every
    rank trains on its shard with DDP over gloo and rank 0 writes the outputs.

    Args:
        config: The `finetune` section of params.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; the checkpoint is `artifacts/finetune/model.safetensors`.
    """
    layout = layout or Layout()
    with torchrun_group() as (rank, world):
        torch.set_num_threads(max(1, config.threads // world))
        meta, train, val, test = load_prepared(layout.stage_dir("validate"))
        check_augmentable("finetune", config.augment, meta.input_shape)
        teacher_path = layout.stage_dir("train") / "model.safetensors"
        baseline = load_checkpoint(teacher_path, fits=meta)
        teacher = baseline.model
        teacher_val = evaluate(teacher, val)[0]
        check_recorded_accuracy(baseline, teacher_val, len(val), teacher_path)
        pruned = load_checkpoint(layout.stage_dir("prune") / "model.safetensors", fits=meta)
        masks = load_masks(layout.stage_dir("prune") / "masks.safetensors")
        model = pruned.model
        run_teacher = None
        # Without augmentation `fit_` caches the teacher's logits in one pass: nothing to export.
        augmented = fit_settings(config).augmented
        if config.teacher_runtime == "onnxruntime" and config.distill_weight > 0 and config.epochs and augmented:
            run_teacher = onnx_forward(
                teacher, meta.input_shape, head_tensors(train.x, 8), max(1, config.threads // world)
            )
        kd = Distillation(
            teacher,
            config.distill_temperature,
            config.distill_weight,
            hidden_weight=config.hidden_distill_weight,
            run_teacher=run_teacher,
            until_accuracy=teacher_val if config.distill_schedule == "while_below_teacher" else None,
        )
        teacher_runtime = "onnxruntime" if run_teacher else ("torch" if kd.teaches else "none")
        fit = FitResult()
        if config.epochs:
            fit = fit_(
                model,
                train,
                val,
                fit_settings(config),
                distillation=kd,
                after_step=(lambda m: apply_masks_(m, masks)) if masks else None,
                desc="finetune",
            )
        else:  # no fine-tuning: the pruned model as it is
            fit.best_val_accuracy = evaluate(model, val)[0]
        make_permanent_(model, masks)
        test_acc, _ = evaluate(model, test)
        base_test, _ = evaluate(teacher, test)
        macs = count_macs(model, meta.input_shape)
        out_dir, metrics_path, plots_dir = (
            layout.stage_dir("finetune"),
            layout.metrics("finetune"),
            layout.plots("finetune"),
        )
        report = FinetuneReport(
            params=count_params(model),
            macs=macs,
            val_accuracy=fit.best_val_accuracy,
            test_accuracy=test_acc,
            baseline_test_accuracy=base_test,
            accuracy_delta_points=100 * (test_acc - base_test),
            mac_reduction=count_macs(teacher, meta.input_shape) / macs,
            weight_zero_fraction=sparsity_report(model, meta.input_shape)["global"]["weight_zero_fraction"],
            epochs_run=len(fit.history),
            world_size=world,
            teacher_runtime=teacher_runtime,
            distilled_epochs=sum(e["distilled"] for e in fit.history),
            checkpoint=out_dir / "model.safetensors",
        )
        if rank != 0:  # rank 0 alone writes; every rank holds the same weights
            return report
        with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
            save_checkpoint(
                staged.dir(out_dir) / "model.safetensors", model, pruned.spec, {**pruned.extra, "stage": "finetune"}
            )
            dump_json(report.metrics(), staged.path(metrics_path))
            taught = f"distilled {report.distilled_epochs} of {report.epochs_run} epochs"
            taught = taught if kd.teaches else "labels only"
            save_fit_history(fit.history, staged.dir(plots_dir), f"Recovery fine-tuning ({taught})")
        return report
