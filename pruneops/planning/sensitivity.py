"""Sensitivity sweeps: how much accuracy each unit (or layer) loses when pruned alone, by a registered estimator."""

from __future__ import annotations

import copy
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
from tqdm.auto import tqdm

from pruneops.config import SensitivityConfig
from pruneops.core.errors import ConfigError
from pruneops.core.inputs import head_tensors, rows
from pruneops.core.plugins import Registry
from pruneops.data import Split
from pruneops.models.profiling import count_macs
from pruneops.pipeline.compute import Backend, LocalBackend
from pruneops.planning.allocation import informative
from pruneops.pruning.fisher import fisher_scores
from pruneops.pruning.heads import head_sites
from pruneops.pruning.importance import IMPORTANCES, Criterion
from pruneops.pruning.masks import apply_masks_
from pruneops.pruning.methods import accumulate_grads_, prunable_weights, topk_masks, training_batches
from pruneops.pruning.units import UnitPruner, round_keep
from pruneops.training.fit import (
    calibration_subset,
    clone_with_grads,
    evaluate,
    parameter_grads,
    recalibrate_batchnorm_,
)


def sweep_units(
    base: torch.nn.Module,
    val: Split,
    criterion: Criterion,
    ratios: list[float],
    input_shape: list[int],
    batch_size: int,
    baseline: tuple[float, float],
    calibration: np.ndarray | None = None,
    backend: Backend | None = None,
) -> tuple[dict[str, dict], dict[str, float], list[str]]:
    """Prunes each structured unit alone at each ratio.

    `baseline` is the unpruned model's validation (accuracy, loss); with `calibration` inputs,
    each trial's BatchNorm statistics are re-estimated on them before it is scored. The trials
    are independent: `backend` runs them (default here, one after another), and the curves are
    the same wherever they ran.

    Returns:
        Curves per unit, each unit's MAC weight, and what the criterion could not do.
    """
    base_acc, base_loss = baseline
    example = head_tensors(val.x)
    units = UnitPruner(base, example, criterion).units()
    jobs = unit_trials(units, ratios)
    # The trials keep the base model's gradients: a gradient criterion ranks with them.
    shared = (base, parameter_grads(base), val, example, criterion, calibration, batch_size, input_shape)
    results = (backend or LocalBackend()).map(_unit_trial, [(n, keep) for n, keep, _ in jobs], shared, "sensitivity")
    base_macs = count_macs(base, input_shape)
    curves = {name: _empty_curve(unit.kind, unit.size) for name, unit in units.items()}
    warnings: list[str] = []
    for (name, _, effective), (acc, loss, macs, said) in zip(jobs, results, strict=True):
        warnings += [w for w in said if w not in warnings]
        _record(curves[name], effective, acc, loss, base_acc, base_loss)
        curves[name]["mac_saving"].append(base_macs - macs)
    # A unit's weight is the MACs one removed fraction of it saves, so the target tracks compute.
    weights = {
        n: sum(s / r for s, r in zip(c["mac_saving"], c["ratios"], strict=True)) / max(len(c["ratios"]), 1)
        for n, c in curves.items()
    }
    return curves, weights, warnings


def unit_trials(units: dict, ratios: list[float]) -> list[tuple[str, int, float]]:
    """(unit, channels kept, effective ratio) of every distinct trial: each ratio rounded to whole channels."""
    jobs = []
    for name, unit in units.items():
        seen: set[float] = set()
        for ratio in ratios:
            keep = round_keep(unit.size, ratio, None)
            effective = 1.0 - keep / unit.size
            if effective > 0.0 and effective not in seen:
                seen.add(effective)
                jobs.append((name, keep, effective))
    return jobs


def _unit_trial(
    base: torch.nn.Module,
    grads: dict[str, torch.Tensor],
    val: Split,
    example: torch.Tensor,
    criterion: Criterion,
    calibration: np.ndarray | None,
    batch_size: int,
    input_shape: list[int],
    name: str,
    keep: int,
) -> tuple[float, float, int, list[str]]:
    """One unit cut to `keep` in a copy of `base`: validation (accuracy, loss), MACs, warnings."""
    trial = clone_with_grads(base, grads)
    pruner = UnitPruner(trial, example, criterion)
    pruner.prune_to_({name: keep})
    if calibration is not None:
        recalibrate_batchnorm_(trial, calibration, batch_size)
    acc, loss = evaluate(trial, val, batch_size)
    return acc, loss, count_macs(trial, input_shape), list(pruner.warnings)


def sweep_layers(
    base: torch.nn.Module,
    val: Split,
    ratios: list[float],
    batch_size: int,
    baseline: tuple[float, float],
    calibration: np.ndarray | None = None,
    backend: Backend | None = None,
) -> tuple[dict[str, dict], dict[str, float]]:
    """Magnitude-prunes each layer's weights alone at each ratio: curves, and weight counts.

    `baseline` is the unpruned model's validation (accuracy, loss); `calibration` and `backend`
    as in `sweep_units`.
    """
    base_acc, base_loss = baseline
    curves = {n: _empty_curve("weights", w.numel()) for n, w in prunable_weights(base).items()}
    jobs = [(name, r) for name in curves for r in ratios]
    shared = (base, val, calibration, batch_size)
    results = (backend or LocalBackend()).map(_layer_trial, jobs, shared, "sensitivity")
    for (name, ratio), (acc, loss) in zip(jobs, results, strict=True):
        _record(curves[name], ratio, acc, loss, base_acc, base_loss)
    return curves, {n: float(c["size"]) for n, c in curves.items()}


def _layer_trial(
    base: torch.nn.Module, val: Split, calibration: np.ndarray | None, batch_size: int, name: str, ratio: float
) -> tuple[float, float]:
    """One layer's weights magnitude-pruned by `ratio` in a copy of `base`: validation (accuracy, loss)."""
    trial = copy.deepcopy(base)
    w = prunable_weights(trial)[name]
    apply_masks_(trial, topk_masks({name: w.detach().abs()}, {name: ratio}, "layer"))
    if calibration is not None:
        recalibrate_batchnorm_(trial, calibration, batch_size)
    return evaluate(trial, val, batch_size)


def _empty_curve(kind: str, size: int) -> dict:
    return {"kind": kind, "size": size, "ratios": [], "accuracy_drop": [], "loss_increase": [], "mac_saving": []}


def _record(curve: dict, ratio: float, acc: float, loss: float, base_acc: float, base_loss: float) -> None:
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


def stratified_subset(split: Split, n: int, seed: int) -> Split:
    """`n` samples of `split` drawn by `seed`, each class in its share (rounded), in their original order."""
    rng = np.random.default_rng(seed)
    classes, counts = np.unique(split.y, return_counts=True)
    quotas = np.floor(counts * n / len(split)).astype(int)
    # The samples that rounding down left out go to the classes with the largest remainders.
    short = n - int(quotas.sum())
    quotas[np.argsort(-(counts * n / len(split) - quotas), kind="stable")[:short]] += 1
    quotas = np.minimum(quotas, counts)
    picks = np.concatenate(
        [rng.choice(np.flatnonzero(split.y == c), q, replace=False) for c, q in zip(classes, quotas, strict=True)]
    )
    picks = np.sort(picks)
    return Split(rows(split.x, picks), split.y[picks])


@dataclass(frozen=True)
class Sweep:
    """What an estimator returns: curves per unit, each unit's weight, warnings, tensors to keep."""

    curves: dict[str, dict]
    weights: dict[str, float]
    warnings: list[str]
    tensors: dict[str, torch.Tensor] = field(default_factory=dict)  # saved as FISHER_SCORES_FILE


@dataclass(frozen=True)
class Estimator:
    """A way to get sensitivity curves.

    `sweep(config, base, train, val, input shape, structured, baseline (acc, loss), backend) -> Sweep`
    (a backend runs its independent evaluations, `pruneops.pipeline.compute`);
    `measures_accuracy`: its curves are validation accuracy drops (comparable with chance, and each
    point one evaluation), not a predicted cost.
    """

    sweep: Callable[..., Sweep]
    measures_accuracy: bool


ESTIMATORS: Registry[Estimator] = Registry("sensitivity estimator")


def evaluate_sweep(
    config: SensitivityConfig,
    base,
    train: Split,
    val: Split,
    shape,
    structured: bool,
    baseline,
    backend: Backend | None = None,
):
    """Measured curves: units (structured methods) or layers (unstructured), each pruned alone (on `backend`)."""
    criterion = IMPORTANCES.get(config.importance)
    if criterion.needs_grad:
        accumulate_grads_(base, train, 4, 64)
    calibration = calibration_subset(train.x, config.bn_recalibration_samples, config.seed)
    if structured:
        return Sweep(
            *sweep_units(base, val, criterion, config.ratios, shape, config.batch_size, baseline, calibration, backend)
        )
    curves, weights = sweep_layers(base, val, config.ratios, config.batch_size, baseline, calibration, backend)
    return Sweep(curves, weights, [])


def fisher_sweep(
    config: SensitivityConfig,
    base,
    train: Split,
    val: Split,
    shape,
    structured: bool,
    baseline,
    backend: Backend | None = None,
):
    """Predicted curves: the loss increase of removing a unit's lowest-Fisher heads or neurons.

    With the diagonal empirical Fisher information F of a mask on each head/neuron, removing a
    set S raises the loss by about 1/2 sum over S of F (Kwon et al. 2022, eq. 6; interactions
    between removed items are ignored). The items removed at a ratio are those with the lowest F,
    as the `fisher` pruning method removes them. A unit with no mask site (channels that feed a
    convolution, not a Linear) cannot be scored: it is left out of the curves, so the allocation
    leaves it whole, and a warning says so. Each unit's MAC weight comes from one trial pruned to
    the largest ratio.

    Raises:
        ConfigError: An unstructured method (the estimator scores heads and neurons, not weights).
    """
    if not structured:
        raise ConfigError(
            "sensitivity.estimator: fisher predicts curves for heads and neurons (structured prune.method: "
            "channel, head, fisher); use evaluate for unstructured methods"
        )
    example = head_tensors(val.x)
    criterion = IMPORTANCES.get(config.importance)
    pruner = UnitPruner(base, example, criterion)
    count = -(-config.fisher_samples // config.batch_size)
    samples = min(len(train), count * config.batch_size)
    heads, channels = fisher_scores(
        base, head_sites(base), pruner.linear_consumers(), training_batches(train, count, config.batch_size)
    )
    # Kept for the prune stage: its `fisher` method ranks the same model's heads/neurons by them.
    tensors = {**{f"head:{n}": t for n, t in heads.items()}, **{f"channel:{n}": t for n, t in channels.items()}}
    members = pruner.head_unit_members()
    base_macs = count_macs(base, shape)
    curves, weights, warnings = {}, {}, []
    for name, unit in tqdm(pruner.units().items(), desc="sensitivity (fisher)", unit="unit", disable=None):
        scores = sum(heads[s] for s in members[name]) if name in members else channels.get(name)
        if scores is None:
            warnings.append(f"unit {name} has no Fisher score (its channels feed no Linear): left whole")
            continue
        ordered = torch.sort(scores.double()).values
        curve = {"kind": unit.kind, "size": unit.size, "ratios": [], "predicted_loss_increase": []}
        keep = unit.size
        for ratio in config.ratios:
            keep = round_keep(unit.size, ratio, None)
            effective = 1.0 - keep / unit.size
            if effective == 0.0 or effective in curve["ratios"]:
                continue
            curve["ratios"].append(effective)
            curve["predicted_loss_increase"].append(0.5 * float(ordered[: unit.size - keep].sum()) / samples)
        if curve["ratios"]:
            trial = copy.deepcopy(base)
            UnitPruner(trial, example, criterion).prune_to_({name: keep})
            weights[name] = (base_macs - count_macs(trial, shape)) / curve["ratios"][-1]
            curves[name] = curve
    return Sweep(curves, weights, warnings, tensors)


ESTIMATORS.register("evaluate", "prune each unit alone at each ratio and measure the validation accuracy drop")(
    Estimator(evaluate_sweep, measures_accuracy=True)
)

ESTIMATORS.register(
    "fisher",
    "predict each unit's loss increase from the Fisher information of a mask on its heads/neurons "
    "(Kwon et al. 2022): no evaluation; structured methods",
)(Estimator(fisher_sweep, measures_accuracy=False))
