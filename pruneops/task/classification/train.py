"""`train` stage: the baseline model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch

from pruneops.config import TrainConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data import load_prepared
from pruneops.data.augment import check_augmentable
from pruneops.models import ModelSpec, classifier_of, create_model
from pruneops.models.checkpoint import save_checkpoint
from pruneops.models.init_weights import AdoptedWeights, load_init_weights_
from pruneops.models.profiling import count_macs, count_params
from pruneops.pipeline.stages import StageReport
from pruneops.reports.plots import save_fit_history
from pruneops.training.fit import FitResult, evaluate, fit_, fit_settings, seed_everything


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
    init_weights: str | None = None  # the file the weights came from (None: trained from scratch)
    reset_classifier: bool = False
    warnings: tuple[str, ...] = ()

    def summary(self) -> str:
        return (
            f"{self.model}: test accuracy {100 * self.test_accuracy:.2f}%, {self.params:,} params, "
            f"{self.macs:,} MACs -> {self.checkpoint}"
        )


def train_baseline(config: TrainConfig, layout: Layout | None = None) -> TrainReport:
    """Trains the configured architecture (from `init_weights` when given) and saves it as safetensors.

    With `epochs: 0` the loaded weights are the baseline as they are: evaluated and recorded.

    Args:
        config: The `train` section of params.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; the checkpoint is `artifacts/train/model.safetensors`.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    preprocess = config.preprocess.model_dump(exclude_none=True) if config.preprocess else None
    kwargs = dict(config.model_kwargs)
    if config.pretrained:  # the architecture travels in the checkpoint, not as a path to the folder
        from pruneops.models.hf import pretrained_config

        kwargs = {"hf_config": pretrained_config(config.pretrained, kwargs)}
    spec = ModelSpec(
        config.model, meta.input_shape, meta.num_classes, kwargs, config.classifier, preprocess, meta.inputs
    )
    check_augmentable("train", config.augment, meta.input_shape)
    seed_everything(config.seed)
    model = create_model(spec)
    adopted = None
    if config.init_weights:
        adopted = load_init_weights_(model, Path(config.init_weights), config.init_strict, config.reset_classifier)
    elif config.pretrained:
        from pruneops.models.hf import load_pretrained_

        fresh = load_pretrained_(model, config.pretrained)
        adopted = AdoptedWeights(config.pretrained, reset_classifier=bool(fresh), warnings=fresh)
    fit = FitResult()  # epochs 0: the weights adopted as they are
    if config.epochs:
        head = classifier_of(model) if config.freeze_backbone_epochs else None
        fit = fit_(model, train, val, fit_settings(config), desc="train", frozen_except=head)
    val_acc, _ = evaluate(model, val)  # recorded: later stages refuse weights that no longer reach it
    if not config.epochs:
        fit.best_val_accuracy = val_acc
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
        init_weights=config.init_weights or config.pretrained,
        reset_classifier=adopted.reset_classifier if adopted else False,
        warnings=tuple(adopted.warnings) if adopted else (),
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        extra = {"stage": "train", "val_accuracy": val_acc, "val_samples": len(val)}
        save_checkpoint(staged.dir(out_dir) / "model.safetensors", model, spec, extra)
        dump_json(report.metrics(), staged.path(metrics_path))
        save_fit_history(fit.history, staged.dir(plots_dir), f"Baseline training: {config.model}")
    return report
