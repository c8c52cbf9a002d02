"""`train` stage: the baseline model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pruneops.checkpoint import save_checkpoint
from pruneops.config import TrainConfig
from pruneops.data import load_prepared
from pruneops.io import Layout, dump_json, staged_output_paths
from pruneops.models import ModelSpec, create_model
from pruneops.plots import save_fit_history
from pruneops.profiling import count_macs, count_params
from pruneops.stages import StageReport
from pruneops.training import FitSettings, evaluate, fit_, seed_everything


@dataclass(frozen=True)
class TrainReport(StageReport):
    """The baseline's figures."""

    model: str
    params: int
    macs: int
    val_accuracy: float
    test_accuracy: float
    test_loss: float
    best_epoch: int
    epochs_run: int
    checkpoint: Path

    def summary(self) -> str:
        return (
            f"{self.model}: test accuracy {100 * self.test_accuracy:.2f}%, {self.params:,} params, "
            f"{self.macs:,} MACs -> {self.checkpoint}"
        )


def fit_settings(config: TrainConfig) -> FitSettings:
    """The training-loop settings of a `FitParams` section."""
    return FitSettings(config.epochs, config.batch_size, config.lr, config.weight_decay, config.patience, config.seed)


def train_baseline(config: TrainConfig, layout: Layout | None = None) -> TrainReport:
    """Trains the configured architecture on the prepared splits and saves it as safetensors.

    Args:
        config: The `train` section of params.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; the checkpoint is `artifacts/train/model.safetensors`.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    spec = ModelSpec(config.model, meta.input_shape, meta.num_classes, dict(config.model_kwargs), config.classifier)
    seed_everything(config.seed)
    model = create_model(spec)
    fit = fit_(model, train, val, fit_settings(config), desc="train")
    val_acc, _ = evaluate(model, val)  # recorded: later stages refuse weights that no longer reach it
    test_acc, test_loss = evaluate(model, test)
    out_dir, metrics_path, plots_dir = layout.stage_dir("train"), layout.metrics("train"), layout.plots("train")
    report = TrainReport(
        model=config.model,
        params=count_params(model),
        macs=count_macs(model, meta.input_shape),
        val_accuracy=fit.best_val_accuracy,
        test_accuracy=test_acc,
        test_loss=test_loss,
        best_epoch=fit.best_epoch,
        epochs_run=len(fit.history),
        checkpoint=out_dir / "model.safetensors",
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        extra = {"stage": "train", "val_accuracy": val_acc, "val_samples": len(val)}
        save_checkpoint(staged.dir(out_dir) / "model.safetensors", model, spec, extra)
        dump_json(report.metrics(), staged.path(metrics_path))
        save_fit_history(fit.history, staged.dir(plots_dir), f"Baseline training: {config.model}")
    return report
