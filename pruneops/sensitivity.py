"""`sensitivity` stage: prune each unit alone at a sweep of ratios; allocate per-unit ratios."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import check_recorded_accuracy, load_checkpoint
from pruneops.config import LATENCY_TARGETS, BenchmarkConfig, PruneConfig, SensitivityConfig
from pruneops.data import Split, load_prepared
from pruneops.inputs import head_tensors
from pruneops.io import Layout, dump_json, staged_output_paths
from pruneops.plots import plot_sensitivity
from pruneops.profiling import count_macs
from pruneops.pruning import IMPORTANCES, METHODS, UnitPruner, round_keep
from pruneops.pruning.allocation import chance_drop, informative
from pruneops.pruning.importance import Criterion
from pruneops.pruning.masks import apply_masks_
from pruneops.pruning.methods import accumulate_grads_, prunable_weights, topk_masks
from pruneops.stages import StageReport
from pruneops.training import calibration_subset, clone_with_grads, evaluate, recalibrate_batchnorm_


@dataclass(frozen=True)
class SensitivityReport(StageReport):
    """What the sweep measured: how many units, how many evaluations, the baseline it compared to."""

    units: int
    evaluations: int
    granularity: str
    baseline_val_accuracy: float
    warnings: tuple[str, ...]
    sweep: Path

    def summary(self) -> str:
        return f"{self.units} {self.granularity}, {self.evaluations} evaluations -> {self.sweep}"


def sweep_units(
    base: torch.nn.Module,
    val: Split,
    criterion: Criterion,
    ratios: list[float],
    input_shape: list[int],
    batch_size: int,
    baseline: tuple[float, float],
    calibration: np.ndarray | None = None,
) -> tuple[dict[str, dict], dict[str, float], list[str]]:
    """Prunes each structured unit alone at each ratio.

    `baseline` is the unpruned model's validation (accuracy, loss); with `calibration` inputs,
    each trial's BatchNorm statistics are re-estimated on them before it is scored.

    Returns:
        Curves per unit, each unit's MAC weight, and what the criterion could not do.
    """
    base_acc, base_loss = baseline
    example = head_tensors(val.x)
    units = UnitPruner(base, example, criterion).units()
    base_macs = count_macs(base, input_shape)
    curves: dict[str, dict] = {}
    warnings: list[str] = []
    jobs = [(name, r) for name in units for r in ratios]
    for name, ratio in tqdm(jobs, desc="sensitivity", unit="eval", disable=None, leave=False):
        size = units[name].size
        keep = round_keep(size, ratio, None)
        effective = 1.0 - keep / size
        curve = curves.setdefault(name, _empty_curve(units[name].kind, size))
        if effective == 0.0 or effective in curve["ratios"]:
            continue
        # The trial keeps the base model's gradients: a gradient criterion ranks with them.
        trial = clone_with_grads(base)
        pruner = UnitPruner(trial, example, criterion)
        pruner.prune_to_({name: keep})
        warnings += [w for w in pruner.warnings if w not in warnings]
        if calibration is not None:
            recalibrate_batchnorm_(trial, calibration, batch_size)
        _record(curve, effective, trial, val, batch_size, base_acc, base_loss)
        curve["mac_saving"].append(base_macs - count_macs(trial, input_shape))
    # A unit's weight is the MACs one removed fraction of it saves, so the target tracks compute.
    weights = {
        n: sum(s / r for s, r in zip(c["mac_saving"], c["ratios"], strict=True)) / max(len(c["ratios"]), 1)
        for n, c in curves.items()
    }
    return curves, weights, warnings


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
        trial = clone_with_grads(base)
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


def uninformative_units(curves: dict[str, dict], at_chance: float) -> list[str]:
    """What to say about units whose every measured ratio fell to chance."""
    return [
        f"unit {name} falls to chance at every ratio swept: how much of it can go is unknown, so it is left "
        "whole; set sensitivity.bn_recalibration_samples (adaptive BN) or sweep smaller sensitivity.ratios"
        for name, curve in curves.items()
        if curve["ratios"] and informative(curve, at_chance) == 0
    ]


def measure_latency(
    base: torch.nn.Module, val: Split, curves: dict[str, dict], shape: list[int], threads: int, batches: list[int]
):
    """The latency model of the baseline's units on this machine (see `pruneops.latency`)."""
    from pruneops.latency import LatencyTable, build_latency_model, machine_fingerprint

    table = LatencyTable(machine_fingerprint(threads))
    units = [(n, c["size"]) for n, c in curves.items()]
    return build_latency_model(base, head_tensors(val.x), shape, units, table, batches)


def analyze_sensitivity(
    config: SensitivityConfig, prune: PruneConfig, benchmark: BenchmarkConfig, layout: Layout | None = None
) -> SensitivityReport:
    """Measures each unit's validation accuracy drop when pruned alone (and, for latency targets, its cost).

    Structured methods sweep units (channel groups, attention heads) and weight them by MACs;
    unstructured methods sweep each layer's weights by magnitude and weight them by count. The
    `prune` stage allocates per-unit ratios for its target from this sweep. With
    `prune.use_sensitivity` off nothing is swept. With a latency target, the latency table of
    every unit is measured here on this machine (`latency.json`, `latency_table.json`), at the
    benchmark's thread count and batch sizes.

    Args:
        config: The `sensitivity` section of params.
        prune: The `prune` section: its method decides the granularity, its target whether to time.
        benchmark: The `benchmark` section: the thread count and batch sizes latency is timed at.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; `artifacts/sensitivity/sensitivity.json` and a PNG of the curves.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, _ = load_prepared(layout.stage_dir("validate"))
    base_path = layout.stage_dir("train") / "model.safetensors"
    checkpoint = load_checkpoint(base_path)
    base = checkpoint.model
    structured = METHODS.get(prune.method).structured
    base_acc, base_loss = evaluate(base, val, config.batch_size)
    check_recorded_accuracy(checkpoint, base_acc, len(val), base_path)
    chance = float(np.bincount(val.y).max() / len(val))
    at_chance = chance_drop(base_acc, chance, len(val))
    curves, weights, warnings = {}, {}, []
    if prune.use_sensitivity:
        curves, weights, warnings = _sweep(
            config, base, train, val, meta.input_shape, structured, (base_acc, base_loss)
        )
        warnings += uninformative_units(curves, at_chance)
    latency = None
    if structured and prune.target in LATENCY_TARGETS:
        # Every batch a target may name (checked at load), so the table outlives a change of target batch.
        batches = sorted({1, *benchmark.batch_sizes})
        latency = measure_latency(base, val, curves, meta.input_shape, benchmark.threads, batches)
    sweep = {
        "baseline_val_accuracy": base_acc,
        "baseline_val_loss": base_loss,
        "chance_accuracy": chance,
        "chance_drop": at_chance,
        "val_samples": len(val),
        "importance": config.importance,
        "granularity": "units" if structured else "layers",
        "units": curves,
        "weights": weights,
    }
    report = SensitivityReport(
        len(curves),
        sum(len(c["ratios"]) for c in curves.values()),
        sweep["granularity"],
        base_acc,
        tuple(warnings),
        layout.stage_dir("sensitivity") / "sensitivity.json",
    )
    _write(layout, sweep, latency, report)
    return report


def _sweep(config: SensitivityConfig, base, train: Split, val: Split, shape, structured: bool, baseline):
    criterion = IMPORTANCES.get(config.importance)
    if criterion.needs_grad:
        accumulate_grads_(base, train, 4, 64)
    calibration = calibration_subset(train.x, config.bn_recalibration_samples, config.seed)
    if structured:
        return sweep_units(base, val, criterion, config.ratios, shape, config.batch_size, baseline, calibration)
    curves, weights = sweep_layers(base, val, config.ratios, config.batch_size, baseline, calibration)
    return curves, weights, []


def _write(layout: Layout, sweep: dict, latency, report: SensitivityReport) -> None:
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("sensitivity"),
        layout.metrics("sensitivity"),
        layout.plots("sensitivity"),
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        dump_json(sweep, tmp / "sensitivity.json")
        if latency is not None:
            dump_json(latency.to_json(), tmp / "latency.json")
            latency.table.save(tmp / "latency_table.json")
        dump_json(report.metrics(), staged.path(metrics_path))
        plots = staged.dir(plots_dir)
        rows = [
            {"unit": n, "ratio": r, "accuracy_drop": d}
            for n, c in sweep["units"].items()
            for r, d in zip(c["ratios"], c["accuracy_drop"], strict=True)
        ]
        dump_json(rows, plots / "curves.json")
        plot_sensitivity(sweep["units"], {}, plots / "sensitivity.png")
