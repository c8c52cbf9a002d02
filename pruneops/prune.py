"""`prune` stage: iterative pruning to the target on a schedule, fine-tuning between steps."""

from __future__ import annotations

import copy
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import check_recorded_accuracy, load_checkpoint, save_checkpoint
from pruneops.config import PruneConfig
from pruneops.data import Split, load_prepared
from pruneops.errors import DataError
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.plots import plot_history, plot_sensitivity
from pruneops.profiling import count_macs, count_params
from pruneops.pruning import IMPORTANCES, METHODS, SCHEDULES, PruneContext, layer_shapes, sparsity_report
from pruneops.pruning.allocation import Allocation, allocate_for_target, ratio_for_budget
from pruneops.pruning.masks import save_masks
from pruneops.stages import StageReport
from pruneops.training import FitSettings, calibration_subset, evaluate, fit_, recalibrate_batchnorm_


@dataclass(frozen=True)
class PruneReport(StageReport):
    """Where pruning ended.

    `summed_isolated_drop` is what the allocation minimised: the sum over units of the validation
    accuracy drop each chosen ratio caused alone in the sweep, before any fine-tuning. It ranks
    allocations; it is not a forecast of the final accuracy (it can exceed 1). None without one.
    """

    method: str
    target: str | None
    target_value: float | None
    target_ratio: float
    achieved_ratio: float | None
    summed_isolated_drop: float | None
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
    warnings: tuple[str, ...]
    checkpoint: Path

    def summary(self) -> str:
        return (
            f"{self.method}: {self.mac_reduction:.2f}x fewer MACs, {self.param_reduction:.2f}x fewer params, "
            f"{100 * self.weight_zero_fraction:.1f}% zero weights, val accuracy {100 * self.val_accuracy:.2f}%; "
            f"speed-up: {self.speedup} -> {self.checkpoint}"
        )


def load_sweep(layout: Layout, config: PruneConfig) -> dict | None:
    """The sensitivity sweep, when `use_sensitivity` is on.

    Raises:
        DataError: Missing, or swept at another granularity than the method prunes.
    """
    if not config.use_sensitivity:
        return None
    path = layout.stage_dir("sensitivity") / "sensitivity.json"
    try:
        sweep = read_json(path)
    except FileNotFoundError:
        raise DataError(f"{path}: not found; run `pruneops sensitivity` or set prune.use_sensitivity: false") from None
    wanted = "units" if METHODS.get(config.method).structured else "layers"
    if sweep.get("granularity") != wanted:
        raise DataError(
            f"{path}: swept per {str(sweep.get('granularity'))[:-1]}, but prune.method {config.method!r} needs "
            f"per-{wanted[:-1]} curves; rerun `pruneops sensitivity`"
        )
    return sweep


def make_context(config: PruneConfig, train: Split, example: torch.Tensor, ratio: float, ratios: dict | None):
    """The method's context for a resolved ratio and (optional) per-unit allocation."""
    structured = METHODS.get(config.method).structured
    return PruneContext(
        target_ratio=ratio,
        criterion=IMPORTANCES.get(config.criterion),
        example_input=example,
        train=train,
        allocation=ratios if structured else None,
        layer_allocation=None if structured else ratios,
        scope=config.scope or "global",
        round_to=config.round_to,
        batch_size=config.batch_size,
    )


def plan_target(
    config: PruneConfig, sweep: dict | None, model: torch.nn.Module, train: Split, example: torch.Tensor, shape: list
) -> tuple[float, Allocation | None]:
    """The ratio to prune to and its allocation, for a ratio target or a MAC/parameter budget.

    A budget is met by bisection on the ratio, each candidate pruned on a copy of the baseline
    (no training) and counted.
    """
    if sweep is None and config.target in (None, "ratio"):
        return config.target_value or 0.0, None
    if config.target in (None, "ratio"):
        ratio = 0.5 if config.target is None else config.target_value  # 2:4 is half of every group
        return ratio, allocate_for_target(sweep, ratio, config.max_unit_ratio)

    def size_at(ratio: float) -> float:
        alloc = allocate_for_target(sweep, ratio, config.max_unit_ratio) if sweep is not None else None
        twin = copy.deepcopy(model)
        METHODS.get(config.method)(make_context(config, train, example, ratio, alloc and alloc.ratios)).apply_(twin, 1)
        return count_macs(twin, shape) if config.target == "macs" else count_params(twin)

    ratio = ratio_for_budget(size_at, config.target_value)
    return ratio, allocate_for_target(sweep, ratio, config.max_unit_ratio) if sweep is not None else None


def prune_iteratively(config: PruneConfig, layout: Layout | None = None) -> PruneReport:
    """Prunes the baseline step by step to the target, fine-tuning after each step.

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
    base_path = layout.stage_dir("train") / "model.safetensors"
    ckpt = load_checkpoint(base_path)
    model = ckpt.model
    sweep = load_sweep(layout, config)
    example = torch.from_numpy(val.x[:1])
    target_ratio, allocation = plan_target(config, sweep, model, train, example, meta.input_shape)
    ratios = allocation.ratios if allocation is not None else None
    ctx = make_context(config, train, example, target_ratio, ratios)
    method = METHODS.get(config.method)(ctx)
    schedule = SCHEDULES.get(config.schedule)(config.steps)
    reference = layer_shapes(model)

    def record(step: int, fraction: float) -> dict:
        g = sparsity_report(model, meta.input_shape, reference)["global"]
        acc, loss = evaluate(model, val)
        return {
            "step": step,
            "fraction_of_target": fraction,
            "ratio": target_ratio * fraction,
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
    check_recorded_accuracy(ckpt, history[0]["val_accuracy"], len(val), base_path)
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
        target=config.target,
        target_value=config.target_value,
        target_ratio=target_ratio,
        achieved_ratio=allocation.achieved_ratio if allocation else None,
        summed_isolated_drop=allocation.summed_isolated_drop if allocation else None,
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
        warnings=tuple(ctx.warnings),
        checkpoint=out_dir / "model.safetensors",
    )
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        save_checkpoint(tmp / "model.safetensors", model, ckpt.spec, {"stage": "prune", "method": config.method})
        masks = method.masks()
        if masks:
            save_masks(masks, tmp / "masks.safetensors")
        dump_json(sparsity_report(model, meta.input_shape, reference), tmp / "sparsity.json")
        if allocation is not None:
            dump_json({"granularity": sweep["granularity"], **asdict(allocation)}, tmp / "allocation.json")
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
            f"Pruning ({config.method}, {config.schedule}, target {config.target} {config.target_value})",
            plots / "history.png",
        )
        plot_sensitivity(sweep["units"] if sweep else {}, ratios or {}, plots / "allocation.png")
    return report
