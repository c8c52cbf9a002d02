"""`sensitivity` stage: prune each unit alone at a sweep of ratios; allocate per-unit ratios."""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import load_checkpoint
from pruneops.config import SensitivityConfig
from pruneops.data import load_prepared
from pruneops.io import Layout, dump_json, staged_output_paths
from pruneops.plots import plot_sensitivity
from pruneops.profiling import count_macs
from pruneops.pruning import IMPORTANCES, UnitPruner, allocate_ratios, round_keep
from pruneops.pruning.methods import accumulate_grads_
from pruneops.training import evaluate


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


def analyze_sensitivity(
    config: SensitivityConfig, target_ratio: float, layout: Layout | None = None
) -> SensitivityReport:
    """Measures each unit's validation accuracy drop when pruned alone, then allocates ratios.

    Args:
        config: The `sensitivity` section of params.
        target_ratio: The global fraction of channels/heads to remove (`prune.target_ratio`).
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; `artifacts/sensitivity/{sensitivity,allocation}.json` and a PNG of the curves.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, _ = load_prepared(layout.stage_dir("validate"))
    base = load_checkpoint(layout.stage_dir("train") / "model.safetensors").model
    criterion = IMPORTANCES.get(config.importance)
    example = torch.from_numpy(val.x[:1])
    if criterion.needs_grad:
        accumulate_grads_(base, train, 4, 64)
    base_acc, base_loss = evaluate(base, val, config.batch_size)
    units = UnitPruner(base, example, criterion).units()
    base_macs = count_macs(base, meta.input_shape)

    curves: dict[str, dict] = {}
    jobs = [(name, r) for name in units for r in config.ratios]
    bar = tqdm(jobs, desc="sensitivity", unit="eval", disable=None, leave=False)
    for name, ratio in bar:
        size = units[name].size
        keep = round_keep(size, ratio, None)
        effective = 1.0 - keep / size
        curve = curves.setdefault(
            name,
            {
                "kind": units[name].kind,
                "size": size,
                "ratios": [],
                "accuracy_drop": [],
                "loss_increase": [],
                "mac_saving": [],
            },
        )
        if effective == 0.0 or effective in curve["ratios"]:
            continue
        trial = copy.deepcopy(base)
        UnitPruner(trial, example, criterion).prune_to_({name: keep})
        acc, loss = evaluate(trial, val, config.batch_size)
        curve["ratios"].append(effective)
        curve["accuracy_drop"].append(base_acc - acc)
        curve["loss_increase"].append(loss - base_loss)
        curve["mac_saving"].append(base_macs - count_macs(trial, meta.input_shape))
    bar.close()

    # A unit's weight is the MACs one removed fraction of it saves, so the target tracks compute.
    weights = {
        n: sum(s / r for s, r in zip(c["mac_saving"], c["ratios"], strict=True)) / max(len(c["ratios"]), 1)
        for n, c in curves.items()
    }
    allocation = allocate_ratios(curves, weights, target_ratio, config.max_layer_ratio)
    achieved = sum(weights[n] * r for n, r in allocation.items()) / max(sum(weights.values()), 1)
    cost = 0.0
    for name, r in allocation.items():
        c = curves[name]
        if r > 0:
            cost += max(c["accuracy_drop"][: c["ratios"].index(r) + 1])
    evaluations = sum(len(c["ratios"]) for c in curves.values())
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("sensitivity"),
        layout.metrics("sensitivity"),
        layout.plots("sensitivity"),
    )
    report = SensitivityReport(
        len(units), evaluations, base_acc, target_ratio, achieved, cost, out_dir / "allocation.json"
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
                "target_ratio": target_ratio,
                "achieved_ratio": achieved,
                "max_layer_ratio": config.max_layer_ratio,
                "ratios": allocation,
                "mac_weights": weights,
                "sizes": {n: u.size for n, u in units.items()},
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
