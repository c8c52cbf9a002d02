"""`prune` stage: iterative pruning to the target on a schedule, fine-tuning between steps."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import load_checkpoint, save_checkpoint
from pruneops.config import PruneConfig
from pruneops.data import load_prepared
from pruneops.errors import DataError
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.plots import plot_history
from pruneops.pruning import IMPORTANCES, METHODS, SCHEDULES, PruneContext, layer_shapes, sparsity_report
from pruneops.pruning.masks import save_masks
from pruneops.training import FitSettings, calibration_subset, evaluate, fit_, recalibrate_batchnorm_


@dataclass(frozen=True)
class PruneReport:
    """Where pruning ended."""

    method: str
    target_ratio: float
    steps: int
    params: int
    macs: int
    baseline_params: int
    baseline_macs: int
    param_reduction: float
    mac_reduction: float
    weight_zero_fraction: float
    val_accuracy: float
    speedup: str
    checkpoint: Path

    def metrics(self) -> dict:
        """The figures tracked by `dvc metrics`."""
        return {k: v for k, v in self.__dict__.items() if k != "checkpoint"}


def load_allocation(layout: Layout, config: PruneConfig) -> dict[str, float] | None:
    """The sensitivity stage's ratios (per unit or per layer), when `use_sensitivity` is on.

    Raises:
        DataError: Missing, or computed for another target or granularity.
    """
    if not config.use_sensitivity:
        return None
    path = layout.stage_dir("sensitivity") / "allocation.json"
    try:
        alloc = read_json(path)
    except FileNotFoundError:
        raise DataError(f"{path}: not found; run `pruneops sensitivity` or set prune.use_sensitivity: false") from None
    wanted = "units" if METHODS.get(config.method).structured else "layers"
    if abs(alloc["target_ratio"] - config.target_ratio) > 1e-9 or alloc.get("granularity", "units") != wanted:
        raise DataError(
            f"{path}: allocated per {alloc.get('granularity', 'units')} for target {alloc['target_ratio']}, "
            f"but prune.method {config.method!r} at target {config.target_ratio} needs per-{wanted[:-1]} "
            "ratios; rerun `pruneops sensitivity`"
        )
    return alloc["ratios"]


def prune_iteratively(config: PruneConfig, layout: Layout | None = None) -> PruneReport:
    """Prunes the baseline step by step to `target_ratio`, fine-tuning after each step.

    Args:
        config: The `prune` section of params.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; the pruned checkpoint (and masks, for unstructured methods) are under
        `artifacts/prune/`, the per-step history under `plots/prune/`.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, _ = load_prepared(layout.stage_dir("validate"))
    ckpt = load_checkpoint(layout.stage_dir("train") / "model.safetensors")
    model = ckpt.model
    method_cls = METHODS.get(config.method)
    allocation = load_allocation(layout, config)
    ctx = PruneContext(
        target_ratio=config.target_ratio,
        criterion=IMPORTANCES.get(config.importance),
        example_input=torch.from_numpy(val.x[:1]),
        train=train,
        allocation=allocation if method_cls.structured else None,
        layer_allocation=None if method_cls.structured else allocation,
        scope=config.scope,
        round_to=config.round_to,
        batch_size=config.batch_size,
    )
    method = method_cls(ctx)
    schedule = SCHEDULES.get(config.schedule)(config.steps)
    reference = layer_shapes(model)

    def record(step: int, fraction: float) -> dict:
        g = sparsity_report(model, meta.input_shape, reference)["global"]
        acc, loss = evaluate(model, val)
        return {
            "step": step,
            "fraction_of_target": fraction,
            "ratio": config.target_ratio * fraction,
            "weight_zero_fraction": g["weight_zero_fraction"],
            "params": g["params"],
            "nonzero_params": g["nonzero_params"],
            "macs": g["macs"],
            "nonzero_macs": g["nonzero_macs"],
            "val_accuracy": acc,
            "val_loss": loss,
        }

    def tune(epochs: int, seed: int, desc: str) -> None:
        settings = FitSettings(epochs, config.batch_size, config.lr, 1e-4, epochs + 1, seed)
        fit_(model, train, val, settings, after_backward=method.after_backward, after_step=method.after_step, desc=desc)

    history = [record(0, 0.0)]
    if method.needs_warmup:
        # Movement scores come from training: gather them before the first step prunes.
        tune(max(config.epochs_per_step, 1), config.seed, "prune warm-up")
    bar = tqdm(list(enumerate(schedule, 1)), desc="prune", unit="step", disable=None, leave=False)
    # Removing channels changes every later layer's input statistics; re-estimating BatchNorm's
    # running stats (adaptive BN) gives each step's fine-tuning a sound start at no training cost.
    calibration = calibration_subset(train.x, config.bn_recalibration_samples, config.seed)
    for step, fraction in bar:
        method.apply_(model, fraction)
        if calibration is not None:
            recalibrate_batchnorm_(model, calibration)
        if config.epochs_per_step:
            tune(config.epochs_per_step, config.seed + step, f"prune step {step}")
        history.append(record(step, fraction))
        bar.set_postfix(val_acc=f"{history[-1]['val_accuracy']:.4f}", macs=history[-1]["macs"])
    bar.close()

    final, first = history[-1], history[0]
    out_dir, metrics_path, plots_dir = layout.stage_dir("prune"), layout.metrics("prune"), layout.plots("prune")
    report = PruneReport(
        method=config.method,
        target_ratio=config.target_ratio,
        steps=config.steps,
        params=final["params"],
        macs=final["macs"],
        baseline_params=first["params"],
        baseline_macs=first["macs"],
        param_reduction=first["params"] / final["params"],
        mac_reduction=first["macs"] / final["macs"],
        weight_zero_fraction=final["weight_zero_fraction"],
        val_accuracy=final["val_accuracy"],
        speedup=method.speedup,
        checkpoint=out_dir / "model.safetensors",
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        save_checkpoint(tmp / "model.safetensors", model, ckpt.spec, {"stage": "prune", "method": config.method})
        masks = method.masks()
        if masks:
            save_masks(masks, tmp / "masks.safetensors")
        dump_json(sparsity_report(model, meta.input_shape, reference), tmp / "sparsity.json")
        dump_json(report.metrics(), staged.path(metrics_path))
        plots = staged.dir(plots_dir)
        dump_json(history, plots / "history.json")
        plot_history(
            history,
            "step",
            [
                ("val accuracy", ["val_accuracy"]),
                ("MACs", ["macs", "nonzero_macs"]),
                ("params", ["params", "nonzero_params"]),
                ("zero fraction", ["weight_zero_fraction"]),
            ],
            f"Pruning ({config.method}, {config.schedule}, target {config.target_ratio})",
            plots / "history.png",
        )
    return report
