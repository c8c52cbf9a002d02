"""From a prune target to per-unit widths, and the measured gate that keeps a slower model from shipping.

- `plan`: a ratio target allocates from the sweep; a MAC or parameter budget bisects the ratio on
  copies of the baseline; a latency target (`latency_ms`, `latency_ratio`) allocates on the
  latency model the latency stage measured (`pruneops.planning.latency_allocation`).
- `gate`: the planned widths are pruned into a copy, exported and timed against the dense model
  here (interleaved, batch 1 and the benchmark's largest batch), with the same widths rounded up
  to the channel block (16) where any is not a multiple. The rounded widths are taken when they
  measure no slower at every batch size: wider at no cost in milliseconds (latency targets only:
  wider widths would break a MAC, parameter or ratio budget). If the widths are not
  faster than dense by `min_speedup` at batch 1 (or are slower at the large batch), the stage
  backs off: to the rounded widths, then to no pruning at all; the report says which
  (`GateDecision`). A slower model never leaves the stage.
"""

from __future__ import annotations

import copy
import enum
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pruneops.config import BenchmarkConfig, PruneConfig
from pruneops.core.errors import ConfigError
from pruneops.models.profiling import count_macs, count_params
from pruneops.planning.allocation import Allocation, allocate_for_target, ratio_for_budget
from pruneops.planning.latency_model import keep_counts
from pruneops.planning.target import ResolvedTarget, asked, in_form
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner, is_head_unit
from pruneops.runtimes.onnxruntime.timing import measured_latency

CHANNEL_BLOCK = 16  # ONNX Runtime's NCHWc block on AVX-512 (8 on AVX2): whole blocks cost no more


@dataclass
class Plan:
    """Where pruning is headed: the ratio the method prunes to and per-unit ratios.

    For latency targets also the table's prediction for the planned widths, dense, and the target.
    """

    ratio: float
    allocation: Allocation | None = None
    ratios: dict[str, float] | None = None
    predicted_ms: float | None = None
    dense_predicted_ms: float | None = None
    target_ms: float | None = None
    warnings: list[str] = field(default_factory=list)
    aim_ms: float | None = None  # what the table was asked for (the target, or a corrected aim)
    summed_drop: float | None = None  # latency targets: the allocation's summed isolated drop


def plan_ratio_or_budget(
    config: PruneConfig, sweep: dict | None, size_at: Callable[[float, Allocation | None], float]
) -> Plan:
    """A ratio target, or a MAC/parameter budget met by bisection on the ratio."""
    if config.target_kind in (None, "ratio"):
        ratio = 0.5 if config.target is None else config.target.value  # 2:4 is half of every group
        allocation = allocate_for_target(sweep, ratio, config.max_unit_ratio) if sweep is not None else None
        return Plan(ratio, allocation, allocation.ratios if allocation else None)

    def budget_size(ratio: float) -> float:
        allocation = allocate_for_target(sweep, ratio, config.max_unit_ratio) if sweep is not None else None
        return size_at(ratio, allocation)

    ratio = ratio_for_budget(budget_size, config.target.value)
    allocation = allocate_for_target(sweep, ratio, config.max_unit_ratio) if sweep is not None else None
    return Plan(ratio, allocation, allocation.ratios if allocation else None)


def plan_latency(
    config: PruneConfig,
    sweep: dict,
    latency_dir: Path,
    threads: int,
    aim_ms: float | None = None,
    measured: list[tuple[dict[str, int], float]] | None = None,
    loaded: tuple[Any, list[str]] | None = None,
    choose: Callable[[tuple[Any, ...]], int] | None = None,
    target: ResolvedTarget | None = None,
) -> Plan:
    """Per-unit widths for a latency target from the latency stage's table.

    Args:
        config: The prune section (its target, in ms or as a ratio of dense).
        sweep: The sensitivity sweep.
        latency_dir: Where the latency stage wrote `<form>/latency.json` and `<form>/latency_table.json`.
        threads: ONNX Runtime threads (the table's machine fingerprint includes them).
        aim_ms: What to ask the table for instead of the target (a step along the staircase).
        measured: Widths already exported and timed here, each with its measured latency as a
            fraction of dense measured in the same run: the predicted savings at the target
            batch are rescaled to fit them (`recalibrate_`) before the next plan is made.
        loaded: The form's model as `load_latency_model` returned it, where the caller has it
            already (it is read otherwise).
        choose: Given the allocation's shortlist of feasible plans (`PruneConfig.trial_count` of them,
            `PlanOption`s, least summed isolated drop first), the index of the one to plan;
            None plans the first.
        target: The target as resolved (`pruneops.planning.target`); None: as `config` asks it.

    Raises:
        ConfigError: No latency table, or one timed in another form (rerun the latency stage).
    """
    from pruneops.planning.latency_allocation import allocate_latency

    t = target or asked(config)
    latency, warnings = loaded or load_latency_model(latency_dir, t.form, t.kind, threads)
    batch = t.batch
    if measured:
        recalibrate_(latency, batch, measured)
    dense = latency.predict({}, batch)
    target = t.value if t.kind == "latency_ms" else t.value * dense
    aim = aim_ms if aim_ms is not None else target
    allocation = allocate_latency(
        latency,
        sweep,
        aim,
        batch,
        config.max_unit_ratio,
        sweep.get("chance_drop"),
        shortlist=config.trial_count if choose is not None else 1,
    )
    picked = allocation.options[choose(allocation.options)] if choose and len(allocation.options) > 1 else None
    ratios = picked.ratios if picked else allocation.ratios
    return Plan(
        max(ratios.values(), default=0.0),
        None,
        ratios,
        picked.predicted_ms if picked else allocation.predicted_ms,
        dense,
        target,
        warnings,
        aim,
        (picked or allocation).summed_isolated_drop if allocation.reached else None,
    )


def load_latency_model(latency_dir: Path, form: str, target: str | None, threads: int):
    """The latency stage's model of `form` and, if its table was timed on another machine, a warning.

    Raises:
        ConfigError: No latency table, or none timed in `form` (rerun the latency stage).
    """
    from pruneops.core.io import read_json
    from pruneops.planning.forms import FORMS_FILE
    from pruneops.planning.latency_model import LatencyModel
    from pruneops.runtimes.onnxruntime.layers import LatencyTable
    from pruneops.timing.machine import machine_fingerprint

    if not (latency_dir / FORMS_FILE).is_file():
        raise ConfigError(f"prune.target.kind: {target} needs the latency table; run `pruneops latency`")
    path = latency_dir / form / "latency.json"
    if not path.is_file():
        timed = ", ".join(sorted(p.parent.name for p in latency_dir.glob("*/latency.json")))
        raise ConfigError(
            f"prune.target.form: {form}, but the latency table was timed in {timed}; rerun `pruneops latency`"
        )
    table, same = LatencyTable.load(path.parent / "latency_table.json", machine_fingerprint(threads))
    warnings = [] if same else ["the latency table was measured on another machine: layers re-measured here"]
    return LatencyModel.from_json(read_json(path), table), warnings


def choose_latency_form(
    config: PruneConfig, sweep: dict, latency_dir: Path, threads: int, target: ResolvedTarget | None = None
) -> tuple[ResolvedTarget, list[dict[str, Any]]]:
    """For `prune.target.form: auto`: the target in the form to plan in, and every form's plan.

    Each form the latency stage timed for planning (`forms.json`) is asked for the target:
    `latency_ms` as it is, `latency_ratio` of dense in the reference form (fp32) turned into the
    ratio of dense in that form, both as the tables predict them; an INT8 form that is faster
    dense needs fewer cuts for the same milliseconds. A ratio is kept no milder than the gate's
    `min_speedup` demands of any pruned model (where INT8 alone is almost fast enough, a milder
    plan would be refused). Kept: the plan that reaches its target with the least summed isolated
    drop (ties: the faster prediction); where none reaches it, the fastest. The sweep measured
    fp32 accuracy: what INT8 costs on top is the quantize stage's tolerance to check. The forms the
    latency stage screened out (slower than fp32) are listed last, with why, never kept.
    """
    from pruneops.core.io import read_json
    from pruneops.planning.forms import FORMS_FILE

    t = target or asked(config)
    forms = read_json(latency_dir / FORMS_FILE)
    batch = t.batch
    # Each table read once (on another machine, reading one re-measures its layers).
    wanted = {forms["reference"], *forms["planned"]}
    loaded = {f: load_latency_model(latency_dir, f, t.kind, threads) for f in wanted}
    reference = loaded[forms["reference"]][0].predict({}, batch)
    mildest = 1.0 / config.gate.min_speedup if config.gate.min_speedup else 1.0
    choices = []
    for form in forms["planned"]:
        value = t.value
        if t.kind == "latency_ratio":
            value = min(t.value * reference / loaded[form][0].predict({}, batch), mildest)
        in_this_form = t.aiming(form=form, value=value)
        planned = plan_latency(config, sweep, latency_dir, threads, loaded=loaded[form], target=in_this_form)
        choices.append(
            {
                "form": form,
                "target_value": value,
                "target_ms": planned.target_ms,
                "predicted_ms": planned.predicted_ms,
                "dense_predicted_ms": planned.dense_predicted_ms,
                "summed_drop": planned.summed_drop,
                "reached": planned.summed_drop is not None,
            }
        )
    reached = [c for c in choices if c["reached"]]
    best = (
        min(reached, key=lambda c: (c["summed_drop"], c["predicted_ms"]))
        if reached
        else min(choices, key=lambda c: c["predicted_ms"] / c["target_ms"])
    )
    for choice in choices:
        choice["chosen"] = choice is best
    screened = forms.get("screened", {})
    choices += [{"form": f, "screened": why, "reached": False, "chosen": False} for f, why in screened.items()]
    return in_form(t, best["form"], best["target_value"], choices), choices


def recalibrate_(latency, batch: int, measured: list[tuple[dict[str, int], float]]) -> None:
    """Rescales `latency`'s predicted savings at `batch` to fit measured widths (fractions of dense).

    The scale is the least-squares fit, through the origin, of measured savings on predicted ones
    (both as fractions of dense): the table keeps ranking the moves, the measurements set how
    much they save here.
    """
    latency.savings_scale.pop(batch, None)
    dense = latency.predict({}, batch)
    predicted = np.array([1.0 - latency.predict(w, batch) / dense for w, _ in measured])
    real = np.array([1.0 - fraction for _, fraction in measured])
    if float(predicted @ predicted) > 1e-12:
        latency.savings_scale[batch] = float(np.clip(predicted @ real / (predicted @ predicted), 0.25, 4.0))


def plan(
    config: PruneConfig,
    sweep: dict | None,
    model: nn.Module,
    make_method: Callable[[float, dict | None], object],
    input_shape: list[int],
    latency_dir: Path,
    threads: int,
    choose: Callable[[tuple[Any, ...]], int] | None = None,
    target: ResolvedTarget | None = None,
) -> Plan:
    """The plan for any target kind (see the module docstring); `choose` and `target` as `plan_latency` takes them.

    Raises:
        ConfigError: A latency target without a sweep, or a `latency_ms` target that dense already
            meets in the form planned (there is nothing to cut for).
    """
    if config.latency_target:
        if sweep is None:
            raise ConfigError(
                f"prune.target.kind: {config.target_kind} allocates from the sweep; set prune.use_sensitivity"
            )
        t = target or asked(config)
        planned = plan_latency(config, sweep, latency_dir, threads, choose=choose, target=t)
        if t.kind == "latency_ms" and planned.target_ms >= planned.dense_predicted_ms:
            raise ConfigError(
                f"prune.target.value: {planned.target_ms:g} ms is not below the dense model's "
                f"{planned.dense_predicted_ms:.4g} ms at batch {t.batch} in {t.form} "
                "(the latency stage's measurement): dense already meets it"
            )
        return planned

    def size_at(ratio: float, allocation: Allocation | None) -> float:
        twin = copy.deepcopy(model)
        make_method(ratio, allocation.ratios if allocation else None).apply_(twin, 1.0)
        return count_macs(twin, input_shape) if config.target_kind == "macs" else count_params(twin)

    return plan_ratio_or_budget(config, sweep, size_at)


class GateDecision(enum.Enum):
    """What the measured gate did with a plan's widths."""

    PASSED = "passed"  # the planned widths, faster than dense by `min_speedup`
    WIDENED = "widened"  # rounded up to whole channel blocks, measured no slower: taken
    BACKED_OFF = "backed off"  # the planned widths too slow; rounded up ones pass
    REFUSED = "refused"  # nothing passes: the dense model goes on unpruned
    NOT_GATED = "not gated"  # `prune.gate.min_speedup: null`: measured and kept whatever they read


@dataclass(frozen=True)
class GateResult:
    """What the measured gate decided, and why (`reason`)."""

    decision: GateDecision
    ratios: dict[str, float] | None  # the ratios to prune to (None: prune nothing)
    speedups: dict[str, float]  # measured speed-up of the widths in `ratios` (as planned if refused) per batch size
    measured_ms: dict[str, float]  # the widths in `ratios` (as planned if refused), per batch size
    dense_ms: dict[str, float] = field(default_factory=dict)  # dense, measured in the same run
    # The widths as planned, per batch size (`measured_ms` unless the gate took others, rounded up):
    # what the latency table predicted, so that its prediction error is of the widths it predicted.
    planned_ms: dict[str, float] = field(default_factory=dict)
    # `prune.target.reference`, measured in the same run, per batch size (empty without one).
    reference_ms: dict[str, float] = field(default_factory=dict)
    reason: str = ""

    @property
    def timed_as_planned(self) -> bool:
        """Whether `measured_ms` are the planned widths' own times (the gate took them, or refused them)."""
        return self.decision not in (GateDecision.WIDENED, GateDecision.BACKED_OFF)

    @property
    def text(self) -> str:
        """The decision as the report and its warnings say it (e.g. `backed off: widths rounded up ...`)."""
        label = "passed" if self.decision is GateDecision.WIDENED else self.decision.value
        return f"{label}: {self.reason}" if self.reason else label

    @property
    def warns(self) -> bool:
        """Whether the stage warns about it: the planned widths were not what passed."""
        return self.decision in (GateDecision.BACKED_OFF, GateDecision.REFUSED)


def _pruned_copy(model: nn.Module, example: torch.Tensor, widths: dict[str, int]) -> nn.Module:
    twin = copy.deepcopy(model)
    UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_(widths)
    return twin


def _rounded(widths: dict[str, int], sizes: dict[str, int]) -> dict[str, int]:
    # Head counts are not channels the kernels tile: rounding 6 of 12 heads up to 16 keeps them all.
    return {
        n: w if is_head_unit(n) else min(sizes[n], -(-w // CHANNEL_BLOCK) * CHANNEL_BLOCK) for n, w in widths.items()
    }


def _speedups_text(dense: dict[int, float], times: dict[int, float], big: int) -> str:
    return f"{dense[1] / times[1]:.2f}x at batch 1 and {dense[big] / times[big]:.2f}x at batch {big}"


def _no_slower(times: dict[int, float], than: dict[int, float]) -> bool:
    return all(times[b] <= than[b] for b in than)


GATE_BUDGET_S = 20.0
# A runoff between plans that separate gate readings put either side of a latency target's
# ceiling: twice a gate's rounds and budget, every plan against the same dense reading.
RUNOFF_ROUNDS = 6
RUNOFF_BUDGET_S = 2 * GATE_BUDGET_S


def retime(
    model: nn.Module,
    example: torch.Tensor,
    input_shape,
    plans: dict[str, dict[str, int]],
    batch: int,
    benchmark: BenchmarkConfig,
    form: str = "fp32",
    reference: Path | None = None,
) -> dict[str, float]:
    """Batch-`batch` ms of dense (as "dense") and of each plan's widths, exported and timed interleaved in one run.

    With `reference` (an ONNX file, `prune.target.reference`) it is timed among them, as "reference".
    """
    timing = BenchmarkConfig(threads=benchmark.threads, batch_sizes=[batch], warmup=5, repeats=30, rounds=RUNOFF_ROUNDS)
    candidates = {"dense": model, **{n: _pruned_copy(model, example, w) for n, w in plans.items()}}
    if reference is not None:
        candidates["reference"] = reference
    times = measured_latency(candidates, input_shape, timing, budget_s=RUNOFF_BUDGET_S, form=form)
    return {n: t[batch] for n, t in times.items()}


def gate(
    model: nn.Module,
    example: torch.Tensor,
    input_shape,
    ratios: dict[str, float],
    sizes: dict[str, int],
    min_speedup: float | None,
    benchmark: BenchmarkConfig,
    form: str = "fp32",
    widen_when_free: bool = True,
    reference: Path | None = None,
) -> GateResult:
    """Measures the planned widths against dense and backs off until they are faster (see the module docstring).

    With `min_speedup` None the widths are measured and reported, and kept whatever they measure.
    Both are timed in `form` (`prune.target.form`): fp32, or quantized as the quantize stage would.
    `widen_when_free` takes the rounded-up widths when they measure no slower; only a latency
    target is still met by wider widths at the same milliseconds (a MAC, parameter or ratio
    budget is not), so the prune stage passes it for latency targets alone. A `reference` ONNX
    file (`prune.target.reference`) is timed with them, as it is, into `reference_ms`.
    """
    timing = BenchmarkConfig(
        threads=benchmark.threads, batch_sizes=sorted({1, *benchmark.batch_sizes}), warmup=5, repeats=30, rounds=3
    )
    big = max(timing.batch_sizes)
    widths = keep_counts(ratios, sizes)
    rounded = _rounded(widths, sizes)
    ladder = [widths] + ([rounded] if rounded != widths else [])
    candidates = {"dense": model, **{f"plan{i}": _pruned_copy(model, example, w) for i, w in enumerate(ladder)}}
    if reference is not None:
        candidates["reference"] = reference
    # Exported and timed interleaved, about GATE_BUDGET_S per batch size (a transformer's large batch
    # runs for tenths of a second, and the gate compares medians with a margin, not percentiles).
    times = measured_latency(candidates, input_shape, timing, budget_s=GATE_BUDGET_S, form=form)
    dense = times["dense"]

    def result(decision: GateDecision, reason: str, kept: dict[str, float] | None, timed: str) -> GateResult:
        t = times[timed]
        return GateResult(
            decision,
            kept,
            {str(b): dense[b] / t[b] for b in timing.batch_sizes},
            {str(b): t[b] for b in timing.batch_sizes},
            {str(b): dense[b] for b in timing.batch_sizes},
            {str(b): times["plan0"][b] for b in timing.batch_sizes},
            {str(b): times["reference"][b] for b in timing.batch_sizes} if reference is not None else {},
            reason,
        )

    if min_speedup is None:
        return result(GateDecision.NOT_GATED, "prune.gate.min_speedup is null: measured, not gated", ratios, "plan0")
    # A back-off says what the planned widths measured, so the user sees why they were not kept.
    planned = f"the planned widths measured {_speedups_text(dense, times['plan0'], big)}"
    block = f"widths rounded up to multiples of {CHANNEL_BLOCK}"
    steps = [(GateDecision.PASSED, "", 0)]
    if len(ladder) > 1:
        steps.append((GateDecision.BACKED_OFF, f"{block} ({planned}: < {min_speedup:g}x, or slower)", 1))
        if widen_when_free and _no_slower(times["plan1"], times["plan0"]):
            # A width off the channel block can cost more than a whole block: wider at no cost in
            # milliseconds is taken (docs/explanation/latency-targets.md#channel-block).
            steps = [(GateDecision.WIDENED, f"{block} (no slower)", 1), steps[0]]
    for decision, reason, i in steps:
        t = times[f"plan{i}"]
        if dense[1] / t[1] >= min_speedup and t[big] <= dense[big]:
            return result(decision, reason, {n: 1.0 - ladder[i][n] / sizes[n] for n in ladder[i]}, f"plan{i}")
    reason = f"{planned} (< {min_speedup:g}x, or slower): nothing is pruned and the dense model passes on"
    return result(GateDecision.REFUSED, reason, None, "plan0")
