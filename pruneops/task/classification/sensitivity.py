"""`sensitivity` stage: prune each unit alone at a sweep of ratios; allocate per-unit ratios."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from safetensors.torch import save_file

from pruneops.config import ComputeConfig, PruneConfig, SensitivityConfig
from pruneops.core.integrity import file_sha256
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.data import load_prepared
from pruneops.models.checkpoint import check_recorded_accuracy, load_checkpoint
from pruneops.pipeline.compute import LocalBackend, open_backend
from pruneops.pipeline.stages import StageReport
from pruneops.planning.allocation import chance_drop, cost_of
from pruneops.planning.sensitivity import ESTIMATORS, Sweep, stratified_subset, uninformative_units
from pruneops.pruning.fisher import FISHER_SCORES_FILE
from pruneops.pruning.methods import METHODS
from pruneops.reports.plots import plot_sensitivity
from pruneops.training.fit import evaluate


@dataclass(frozen=True)
class SensitivityReport(StageReport):
    """What the sweep measured: how many units, how many evaluations, the baseline it compared to."""

    units: int
    evaluations: int
    granularity: str
    baseline_val_accuracy: float
    warnings: tuple[str, ...]
    sweep: Path
    computed_on: str

    def summary(self) -> str:
        return f"{self.units} {self.granularity}, {self.evaluations} evaluations ({self.computed_on}) -> {self.sweep}"


def analyze_sensitivity(
    config: SensitivityConfig, prune: PruneConfig, layout: Layout | None = None, compute: ComputeConfig | None = None
) -> SensitivityReport:
    """Measures each unit's validation accuracy drop when pruned alone.

    Structured methods sweep units (channel groups, attention heads) and weight them by MACs;
    unstructured methods sweep each layer's weights by magnitude and weight them by count. The
    `prune` stage allocates per-unit ratios for its target from this sweep. With
    `prune.use_sensitivity` off nothing is swept. What the units cost in milliseconds is the
    `latency` stage's (so a change of latency form or target does not repeat the sweep).

    Args:
        config: The `sensitivity` section of params.
        prune: The `prune` section: its method decides the granularity.
        layout: Where to read and write; defaults to the current directory.
        compute: The `compute` section: where the evaluations run (the curves do not depend on it).

    Returns:
        The report; `artifacts/sensitivity/sensitivity.json` and a PNG of the curves.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, _ = load_prepared(layout.stage_dir("validate"))
    base_path = layout.stage_dir("train") / "model.safetensors"
    checkpoint = load_checkpoint(base_path, fits=meta)
    base = checkpoint.model
    structured = METHODS.get(prune.method).structured
    base_acc, base_loss = evaluate(base, val, config.batch_size)
    check_recorded_accuracy(checkpoint, base_acc, len(val), base_path)
    if config.val_samples is not None and config.val_samples < len(val):
        val = stratified_subset(val, config.val_samples, config.seed)
        base_acc, base_loss = evaluate(base, val, config.batch_size)
    chance = float(np.bincount(val.y).max() / len(val))
    at_chance = chance_drop(base_acc, chance, len(val))
    estimator = ESTIMATORS.get(config.estimator)
    result, seconds, computed_on = Sweep({}, {}, []), {}, LocalBackend().describe()
    if prune.use_sensitivity:
        started = time.perf_counter()
        with open_backend(compute, layout.root, config.threads) as backend:
            computed_on = backend.describe()
            shape = meta.input_shape
            result = estimator.sweep(config, base, train, val, shape, structured, (base_acc, base_loss), backend)
        seconds["estimator"] = time.perf_counter() - started
        if not estimator.measures_accuracy:
            at_chance = None  # a predicted loss increase is not an accuracy drop: nothing to compare with chance
    curves, weights, warnings = (
        result.curves,
        result.weights,
        result.warnings + uninformative_units(result.curves, at_chance),
    )
    sweep = {
        "baseline_val_accuracy": base_acc,
        "baseline_val_loss": base_loss,
        "chance_accuracy": chance,
        "chance_drop": at_chance,
        "val_samples": len(val),
        "importance": config.importance,
        "estimator": config.estimator,
        "granularity": "units" if structured else "layers",
        "units": curves,
        "weights": weights,
        "seconds": seconds,
        "computed_on": computed_on,
        "model_sha256": file_sha256(base_path),
    }
    report = SensitivityReport(
        len(curves),
        sum(len(c["ratios"]) for c in curves.values()) if estimator.measures_accuracy else 0,
        sweep["granularity"],
        base_acc,
        tuple(warnings),
        layout.stage_dir("sensitivity") / "sensitivity.json",
        computed_on,
    )
    _write(layout, sweep, result.tensors, report)
    return report


def _write(layout: Layout, sweep: dict, tensors: dict, report: SensitivityReport) -> None:
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("sensitivity"),
        layout.metrics("sensitivity"),
        layout.plots("sensitivity"),
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        dump_json(sweep, tmp / "sensitivity.json")
        if tensors:
            save_file({n: t.contiguous() for n, t in tensors.items()}, str(tmp / FISHER_SCORES_FILE))
        dump_json(report.metrics(), staged.path(metrics_path))
        plots = staged.dir(plots_dir)
        # A Fisher sweep's rows carry its predicted cost under the same key, so the DVC plot
        # still draws; the sweep's "estimator" and the PNG's axis say which it is.
        rows = [
            {"unit": n, "ratio": r, "accuracy_drop": d}
            for n, c in sweep["units"].items()
            for r, d in zip(c["ratios"], cost_of(c), strict=True)
        ]
        dump_json(rows, plots / "curves.json")
        plot_sensitivity(sweep["units"], {}, plots / "sensitivity.png")
