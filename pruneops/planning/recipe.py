"""The library entry point: prune a model to a recipe (`pruneops.prune`), what the prune stage runs too.

```python
import pruneops

pruned = pruneops.prune(model, {"target": {"kind": "macs", "value": 2e6}}, train=(x, y), val=(x_val, y_val))
pruned.model, pruned.history[-1]["val_accuracy"]
```

The recipe is the `prune` section of `params.yaml` (a `PruneConfig` or its keys, validated as the
file is). Without per-unit ratios the target is planned here: a ratio, or a MAC or parameter budget
met by bisection (a latency target needs the latency stage's table: run the pipeline, or give the
`ratios` it planned); structured plans are measured against dense (`prune.gate`) before anything
is cut. The model is then pruned in place over the recipe's schedule, each step followed by
adaptive BatchNorm and fine-tuning (with distillation from the unpruned model when the recipe
asks), and the history of every step returned.
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import nn
from tqdm.auto import tqdm

from pruneops.config import BenchmarkConfig, PruneConfig
from pruneops.core.errors import ConfigError
from pruneops.core.inputs import head_tensors
from pruneops.core.params import parse_section
from pruneops.data.splits import Split
from pruneops.models.profiling import count_macs, count_params
from pruneops.planning.loop import gate_plan
from pruneops.planning.targets import GateResult, plan_ratio_or_budget
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import METHODS, PruneContext
from pruneops.pruning.report import layer_shapes, sparsity_report
from pruneops.pruning.schedule import SCHEDULES
from pruneops.training.distillation import Distillation, with_teacher_outputs
from pruneops.training.fit import FitSettings, calibration_subset, evaluate, fit_, recalibrate_batchnorm_


@dataclass
class Pruned:
    """A model pruned to a recipe: the model (pruned in place), every step's figures, what was planned."""

    model: nn.Module
    method: Any  # the pruning method that cut it (its masks, its speed-up note)
    history: list[dict]
    ratios: dict[str, float] | None
    gate: GateResult | None = None
    warnings: list[str] = field(default_factory=list)


def make_context(
    config: PruneConfig, train: Split, example: torch.Tensor, ratio: float, ratios: dict | None, shared=None
):
    """The method's context for a resolved ratio, (optional) per-unit allocation and shared scores."""
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
        base_scores=shared,
    )


def as_split(data: Split | tuple[Any, Sequence[int]]) -> Split:
    """A `Split` of (inputs, labels): an array or named arrays, and integer labels."""
    if isinstance(data, Split):
        return data
    x, y = data
    x = {k: np.asarray(v) for k, v in x.items()} if isinstance(x, dict) else np.asarray(x, dtype=np.float32)
    return Split(x, np.asarray(y, dtype=np.int64))


def prune(
    model: nn.Module,
    recipe: PruneConfig | dict[str, Any],
    train: Split | tuple,
    val: Split | tuple,
    *,
    planned: tuple[float, dict[str, float] | None] | None = None,
    shared: Any = None,
    benchmark: BenchmarkConfig | None = None,
    sweep: dict | None = None,
    warnings: Sequence[str] = (),
    input_shape: Sequence[int] | None = None,
) -> Pruned:
    """Prunes `model` in place to `recipe` and fine-tunes it between steps; returns it with its history.

    Args:
        model: A trained PyTorch model (its first batch of `val` is the example input).
        recipe: The `prune` section: a `PruneConfig`, or its keys as `params.yaml` writes them.
        train: Training data, a `Split` or (inputs, labels).
        val: Validation data, the same.
        planned: (ratio, per-unit ratios or None) already planned and gated (what the prune stage
            passes); None: planned and gated here.
        shared: The method's scores shared across plans (computed here when None).
        benchmark: How a structured plan is timed against dense (threads, batch sizes).
        sweep: The sensitivity sweep to allocate a ratio or budget over (None: uniform).
        warnings: What planning already has to say (kept first among the result's warnings).
        input_shape: One sample's shape (default: `val`'s), what MACs are counted at.

    Raises:
        ConfigError: A bad recipe (one line), or a latency target without its planned ratios.
    """
    config = recipe if isinstance(recipe, PruneConfig) else parse_section("prune", recipe, PruneConfig)
    train, val = as_split(train), as_split(val)
    example = head_tensors(val.x)
    first = next(iter(val.x.values())) if isinstance(val.x, dict) else val.x  # a text model: its token ids
    shape = list(input_shape) if input_shape is not None else list(np.asarray(first).shape[1:])
    method_cls = METHODS.get(config.method)
    if shared is None:
        shared = method_cls.shared_scores(model, make_context(config, train, example, 0.0, None), None)
    gate, notes = None, list(warnings)
    if planned is None:
        planned, gate = _plan(config, model, method_cls, train, example, shape, shared, benchmark, sweep)
        if gate is not None and gate.warns:
            notes.append(f"prune gate {gate.text}")
    ratio, ratios = planned
    ctx = make_context(config, train, example, ratio, ratios, shared)
    ctx.warnings.extend(notes)
    method = method_cls(ctx)
    history = prune_in_steps(config, model, method, train, val, shape)
    return Pruned(model, method, history, ratios, gate, ctx.warnings)


def _plan(config: PruneConfig, model, method_cls, train: Split, example, shape, shared, benchmark, sweep):
    """((ratio, per-unit ratios), gate result) for a ratio or budget target, gated where the method is structured."""
    if config.latency_target:
        raise ConfigError(
            "prune.target.kind: a latency target is planned on the latency stage's table; run the pipeline "
            "(pruneops latency, then prune) or pass the ratios it planned"
        )

    def size_at(r: float, allocation) -> float:
        twin = copy.deepcopy(model)
        ctx = make_context(config, train, example, r, allocation.ratios if allocation else None, shared)
        method_cls(ctx).apply_(twin, 1.0)
        return count_macs(twin, shape) if config.target_kind == "macs" else count_params(twin)

    target = plan_ratio_or_budget(config, sweep, size_at)
    if not method_cls.structured:
        return (target.ratio, target.ratios), None
    gated = gate_plan(config, benchmark or BenchmarkConfig(batch_sizes=[1]), model, example, shape, target)
    return (target.ratio, gated.ratios), gated


def prune_in_steps(config: PruneConfig, model, method, train: Split, val: Split, shape) -> list[dict]:
    """The schedule's steps, each followed by adaptive BN (when on) and fine-tuning; the history."""
    reference = layer_shapes(model)

    def record(step: int, fraction: float) -> dict:
        g = sparsity_report(model, shape, reference)["global"]
        acc, loss = evaluate(model, val)
        return {
            "step": step,
            "fraction_of_target": fraction,
            "ratio": method.ctx.target_ratio * fraction,
            "weight_zero_fraction": g["weight_zero_fraction"],
            "params": g["params"],
            "nonzero_params": g["nonzero_params"],
            "macs": g["macs"],
            "nonzero_macs": g["nonzero_macs"],
            "val_accuracy": acc,
            "val_loss": loss,
        }

    # The unpruned model teaches every step's fine-tuning: what it gives each training sample
    # (logits, block outputs) is computed once, here, for all the steps.
    kd = None
    taught = config.distillation
    if taught.active:
        kd = Distillation(copy.deepcopy(model), taught.temperature, taught.weight, hidden_weight=taught.hidden_weight)
        if config.epochs_per_step > 0 or method.needs_warmup:  # (prune's fitting does not augment)
            kd = with_teacher_outputs(kd, train, augmented=False)
    hooks = {"after_backward": method.after_backward, "after_step": method.after_step}

    def tune(epochs: int, seed: int, desc: str) -> None:
        settings = FitSettings(epochs, config.batch_size, config.lr, 1e-4, epochs + 1, seed)
        fit_(model, train, val, settings, distillation=kd, desc=desc, **hooks)

    history = [record(0, 0.0)]
    if method.needs_warmup:
        # Movement scores come from training: gather them before the first step prunes.
        tune(max(config.epochs_per_step, 1), config.seed, "prune warm-up")
    schedule = SCHEDULES.get(config.schedule)(config.steps)
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
    return history
