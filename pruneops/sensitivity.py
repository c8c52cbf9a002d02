"""`sensitivity` stage: prune each unit alone at a sweep of ratios; allocate per-unit ratios."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import load_checkpoint
from pruneops.config import PruneConfig, SensitivityConfig
from pruneops.data import Split, load_prepared
from pruneops.errors import ConfigError
from pruneops.io import Layout, dump_json, staged_output_paths
from pruneops.plots import plot_sensitivity
from pruneops.profiling import count_macs
from pruneops.pruning import IMPORTANCES, METHODS, UnitPruner, allocate_ratios, round_keep
from pruneops.pruning.allocation import achieved_ratio, interpolated_drop
from pruneops.pruning.importance import Criterion
from pruneops.pruning.masks import apply_masks_
from pruneops.pruning.methods import accumulate_grads_, prunable_weights, topk_masks
from pruneops.training import calibration_subset, evaluate, recalibrate_batchnorm_


@dataclass(frozen=True)
class SensitivityReport:
    """Sweep size and the allocation's cost.

    `summed_isolated_drop` is the objective the allocation minimises: the sum over units of the
    validation accuracy drop each chosen ratio caused alone, before any fine-tuning. It ranks
    allocations; it is not a forecast of the final accuracy (it can exceed 1).
    """

    units: int
    evaluations: int
    baseline_val_accuracy: float
    target_ratio: float
    achieved_ratio: float
    summed_isolated_drop: float
    allocation: Path

    def metrics(self) -> dict:
        """The figures tracked by `dvc metrics`."""
        return {k: v for k, v in self.__dict__.items() if k != "allocation"}


def sweep_units(
    base: torch.nn.Module,
    val: Split,
    criterion: Criterion,
    ratios: list[float],
    input_shape: list[int],
    batch_size: int,
    baseline: tuple[float, float],
    calibration: np.ndarray | None = None,
) -> tuple[dict[str, dict], dict[str, float]]:
    """Prunes each structured unit alone at each ratio: curves, and each unit's MAC weight.

    `baseline` is the unpruned model's validation (accuracy, loss); with `calibration` inputs,
    each trial's BatchNorm statistics are re-estimated on them before it is scored.
    """
    base_acc, base_loss = baseline
    example = torch.from_numpy(val.x[:1])
    units = UnitPruner(base, example, criterion).units()
    base_macs = count_macs(base, input_shape)
    curves: dict[str, dict] = {}
    jobs = [(name, r) for name in units for r in ratios]
    for name, ratio in tqdm(jobs, desc="sensitivity", unit="eval", disable=None, leave=False):
        size = units[name].size
        keep = round_keep(size, ratio, None)
        effective = 1.0 - keep / size
        curve = curves.setdefault(name, _empty_curve(units[name].kind, size))
        if effective == 0.0 or effective in curve["ratios"]:
            continue
        trial = copy.deepcopy(base)
        UnitPruner(trial, example, criterion).prune_to_({name: keep})
        if calibration is not None:
            recalibrate_batchnorm_(trial, calibration, batch_size)
        _record(curve, effective, trial, val, batch_size, base_acc, base_loss)
        curve["mac_saving"].append(base_macs - count_macs(trial, input_shape))
    # A unit's weight is the MACs one removed fraction of it saves, so the target tracks compute.
    weights = {
        n: sum(s / r for s, r in zip(c["mac_saving"], c["ratios"], strict=True)) / max(len(c["ratios"]), 1)
        for n, c in curves.items()
    }
    return curves, weights


def sweep_layers(
    base: torch.nn.Module,
    val: Split,
    ratios: list[float],
    batch_size: int,
    baseline: tuple[float, float],
    calibration: np.ndarray | None = None,
) -> tuple[dict[str, dict], dict[str, float]]:
    """Magnitude-prunes each layer's weights alone at each ratio: curves, and weight counts.

    `baseline` is the unpruned model's validation (accuracy, loss); `calibration` as in
    `sweep_units`.
    """
    base_acc, base_loss = baseline
    curves = {n: _empty_curve("weights", w.numel()) for n, w in prunable_weights(base).items()}
    jobs = [(name, r) for name in curves for r in ratios]
    for name, ratio in tqdm(jobs, desc="sensitivity", unit="eval", disable=None, leave=False):
        trial = copy.deepcopy(base)
        w = prunable_weights(trial)[name]
        masks = topk_masks({name: w.detach().abs()}, {name: ratio}, "layer")
        apply_masks_(trial, masks)
        if calibration is not None:
            recalibrate_batchnorm_(trial, calibration, batch_size)
        _record(curves[name], ratio, trial, val, batch_size, base_acc, base_loss)
    return curves, {n: float(c["size"]) for n, c in curves.items()}


def _empty_curve(kind: str, size: int) -> dict:
    return {"kind": kind, "size": size, "ratios": [], "accuracy_drop": [], "loss_increase": [], "mac_saving": []}


def _record(
    curve: dict, ratio: float, trial: torch.nn.Module, val: Split, batch_size: int, base_acc: float, base_loss: float
) -> None:
    acc, loss = evaluate(trial, val, batch_size)
    curve["ratios"].append(ratio)
    curve["accuracy_drop"].append(base_acc - acc)
    curve["loss_increase"].append(loss - base_loss)


def analyze_sensitivity(
    config: SensitivityConfig, prune: PruneConfig, layout: Layout | None = None
) -> SensitivityReport:
    """Measures each unit's validation accuracy drop when pruned alone, then allocates ratios.

    Structured methods sweep units (channel groups, attention heads) and weight them by MACs;
    unstructured methods sweep each layer's weights by magnitude and weight them by count.

    Args:
        config: The `sensitivity` section of params.
        prune: The `prune` section: its method decides the granularity, its target the goal.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; `artifacts/sensitivity/{sensitivity,allocation}.json` and a PNG of the curves.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, _ = load_prepared(layout.stage_dir("validate"))
    base = load_checkpoint(layout.stage_dir("train") / "model.safetensors").model
    criterion = IMPORTANCES.get(config.importance)
    structured = METHODS.get(prune.method).structured
    target_ratio = prune.target_ratio
    if criterion.needs_grad:
        accumulate_grads_(base, train, 4, 64)
    base_acc, base_loss = evaluate(base, val, config.batch_size)
    calibration = calibration_subset(train.x, config.bn_recalibration_samples, prune.seed)
    if structured:
        curves, weights = sweep_units(
            base, val, criterion, config.ratios, meta.input_shape, config.batch_size, (base_acc, base_loss), calibration
        )
    else:
        curves, weights = sweep_layers(base, val, config.ratios, config.batch_size, (base_acc, base_loss), calibration)
    granularity = "units" if structured else "layers"
    allocation = allocate_ratios(curves, weights, target_ratio, config.max_layer_ratio)
    achieved = achieved_ratio(allocation, weights)
    if prune.use_sensitivity and achieved + 1e-9 < target_ratio:
        raise ConfigError(
            f"prune.target_ratio: {target_ratio} is out of reach of the sweep (at most {achieved:.3f} with "
            f"sensitivity.ratios up to {max(config.ratios)} and sensitivity.max_layer_ratio "
            f"{config.max_layer_ratio}); add higher ratios, raise max_layer_ratio or lower the target"
        )
    cost = sum(interpolated_drop(curves[name], r) for name, r in allocation.items())
    evaluations = sum(len(c["ratios"]) for c in curves.values())
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("sensitivity"),
        layout.metrics("sensitivity"),
        layout.plots("sensitivity"),
    )
    report = SensitivityReport(
        len(curves), evaluations, base_acc, target_ratio, achieved, cost, out_dir / "allocation.json"
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        dump_json(
            {
                "baseline_val_accuracy": base_acc,
                "baseline_val_loss": base_loss,
                "importance": config.importance,
                "units": curves,
            },
            tmp / "sensitivity.json",
        )
        dump_json(
            {
                "method": prune.method,
                "used": prune.use_sensitivity,
                "granularity": granularity,
                "target_ratio": target_ratio,
                "achieved_ratio": achieved,
                "max_layer_ratio": config.max_layer_ratio,
                "ratios": allocation,
                "weights": weights,
                "sizes": {n: c["size"] for n, c in curves.items()},
            },
            tmp / "allocation.json",
        )
        dump_json(report.metrics(), staged.path(metrics_path))
        plots = staged.dir(plots_dir)
        rows = [
            {"unit": n, "ratio": r, "accuracy_drop": d}
            for n, c in curves.items()
            for r, d in zip(c["ratios"], c["accuracy_drop"], strict=True)
        ]
        dump_json(rows, plots / "curves.json")
        plot_sensitivity(curves, allocation, plots / "sensitivity.png")
    return report
