"""The closed latency loop: plans measured against their target until one lands in the band.

`LatencyLoop` owns what every step needs (the resolved config, the target as asked, the model,
its units and the batch the target is at) and returns a typed `LoopResult`. The gate
(`gate_plan`) measures one plan against dense; the loop refits the latency table on the plans
measured so far and asks it again until a plan's reading lands in `LATENCY_BAND` of the target.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pruneops.config import AUTO_FORM, BenchmarkConfig, PruneConfig
from pruneops.core.integrity import file_sha256
from pruneops.core.io import Layout
from pruneops.planning import targets
from pruneops.planning.closed_loop import LoopOptions, close_loop, kept_index
from pruneops.planning.latency_model import keep_counts
from pruneops.planning.target import ResolvedTarget, asked, of_reference
from pruneops.planning.targets import GateDecision, GateResult, Plan
from pruneops.pruning.units import keep_count, unit_sizes
from pruneops.runtimes.onnxruntime.timing import measured_latency

logger = logging.getLogger(__name__)

# A latency target is a ceiling: a plan is kept when it measures at most 1% over the target (the
# noise of one reading) and at most 5% under it, since pruning further than asked costs accuracy
# (docs/explanation/latency-targets.md#band).
LATENCY_BAND = (0.95, 1.01)
LATENCY_RETRIES = 6  # plans re-asked of the refitted table at most; each costs one gate measurement
# A plan in the band but more than about one timing noise under the target leaves budget unspent:
# the loop then measures the next wider plan once, kept if it lands in the band (#reach there).
LATENCY_REACH = 0.98
# Plans whose own gate read at most this far over the target are timed again, interleaved with
# the plan the loop would keep (a runoff): one gate reading is noisy at the band's edge (#runoff).
RUNOFF_TOP = 1.05


def planned_widths(config: PruneConfig, sizes: dict[str, int], target: Plan) -> dict[str, int]:
    """The widths the method will prune to for a plan (as it rounds them)."""
    ratios = target.ratios if target.ratios is not None else dict.fromkeys(sizes, target.ratio)
    return {n: keep_count(n, s, ratios.get(n, 0.0), config.round_to) for n, s in sizes.items()}


def gate_plan(
    config: PruneConfig,
    benchmark: BenchmarkConfig,
    model: nn.Module,
    example: torch.Tensor,
    shape,
    target: Plan,
    goal: ResolvedTarget | None = None,
) -> GateResult:
    """Measures the planned widths (as the method will round them) and backs off if they are not faster.

    `goal` is the target as resolved (its form, batch and reference); None: as `config` asks it.
    """
    goal = goal or asked(config)
    sizes = unit_sizes(model, example)
    widths = planned_widths(config, sizes, target)
    planned = {n: 1.0 - w / sizes[n] for n, w in widths.items()}
    timing = benchmark.model_copy(update={"batch_sizes": sorted({*benchmark.batch_sizes, goal.batch or 1})})
    result = targets.gate(
        model,
        example,
        shape,
        planned,
        sizes,
        config.gate.min_speedup,
        timing,
        goal.form,
        goal.is_latency,
        goal.reference,
    )
    if result.ratios is None:  # refused: every unit kept whole
        return dataclasses.replace(result, ratios=dict.fromkeys(sizes, 0.0))
    return result


def summed_drop(target: Plan) -> float | None:
    """What the allocation minimised: a ratio or budget allocation's, else a latency plan's."""
    return target.allocation.summed_isolated_drop if target.allocation else target.summed_drop


def planned_ms(gated: GateResult, key: str) -> float | None:
    """The widths as planned (what the table predicted), measured: the gate may have taken others."""
    return gated.planned_ms.get(key, gated.measured_ms.get(key))


def predicted_ms(target: Plan, gated: GateResult, key: str) -> float | None:
    """The table's prediction for a plan, anchored on dense as measured with it (None without one).

    The table predicts cost relative to dense; the machine's speed drifts between the latency
    stage and the gate, so the prediction is scaled by dense as the gate measured it.
    """
    if target.predicted_ms is None or not target.dense_predicted_ms:
        return None
    return target.predicted_ms / target.dense_predicted_ms * gated.dense_ms[key]


@dataclass(frozen=True)
class ReferenceAim:
    """`prune.target.reference` timed at the start: the ratio of dense the table plans with, and the record."""

    ratio_of_dense: float
    record: dict

    def resolved(self, config: PruneConfig) -> ResolvedTarget:
        """The target as the table plans with it: a ratio of dense, the reference's path made absolute."""
        return of_reference(config, self.ratio_of_dense, self.record)


def aim_at_reference(
    config: PruneConfig, benchmark: BenchmarkConfig, layout: Layout, model: nn.Module, shape
) -> ReferenceAim | None:
    """With `prune.target.reference`: its ratio of dense as timed here now (None without a reference).

    The table plans in fractions of dense, so the reference and dense are timed once, interleaved,
    at the target batch (in `latency_form`; fp32 under `auto`, whose form choice converts a ratio
    of dense fp32), and the ratio asked of the reference becomes a ratio of dense; the gate then
    holds each plan to the reference's time as read in its own run (`LatencyLoop.goal_ms`).
    """
    if not config.target.reference:
        return None
    path = (layout.root / config.target.reference).resolve()
    batch = config.target.batch
    timing = benchmark.model_copy(update={"batch_sizes": [batch], "warmup": 5, "repeats": 30, "rounds": 3})
    form = "fp32" if config.latency_form == AUTO_FORM else config.latency_form
    times = measured_latency({"dense": model, "reference": path}, shape, timing, budget_s=10.0, form=form)
    of_dense = times["reference"][batch] / times["dense"][batch]
    ratio, note = config.reference_aim(of_dense)
    logger.info(
        "latency target reference %s: %.4f ms at batch %d against dense %.4f (%s): aiming at %.3f of dense",
        path.name, times["reference"][batch], batch, times["dense"][batch], form, ratio,
    )  # fmt: skip
    record = {
        "file": str(path),
        "sha256": file_sha256(path),
        "ms_at_start": times["reference"][batch],
        "dense_ms_at_start": times["dense"][batch],
        "planned_ratio_of_dense": ratio,
    }
    if note is not None:
        record["note"] = note
    return ReferenceAim(ratio, record)


# A classifier's latency target: the band, retries and reach above (a runoff follows, `LatencyLoop`).
LATENCY_LOOP = LoopOptions(LATENCY_BAND, LATENCY_RETRIES, LATENCY_REACH)


@dataclass(frozen=True)
class Measured:
    """One plan and what its gate (or the runoff) read."""

    plan: Plan
    gated: GateResult


@dataclass(frozen=True)
class LoopResult:
    """The plan kept, its reading, and every plan measured (as `PruneReport.latency_plans` lists them)."""

    plan: Plan
    gated: GateResult
    records: tuple[dict, ...]


@dataclass
class LatencyLoop:
    """Closes the loop on milliseconds for a latency target.

    The target is checked on measurements: `latency_ratio` against dense measured in the same
    run, `latency_ms` as is. While the planned widths measure outside `LATENCY_BAND` of the
    target, the table's predicted savings are rescaled to fit every plan measured so far and the
    table asked again (stepping along the staircase past plans already measured),
    `LATENCY_RETRIES` times at most. A plan inside the band but under `LATENCY_REACH` of the
    target is followed by one wider plan. Of the plans measured, the least pruned one within the
    target is kept (else the fastest). Each plan's prediction is the one made before it was
    measured, so the reported prediction error is honest.

    Args:
        config: The resolved `prune` config (its `target_value` the one the table plans with).
        asked_value: `prune.target.value` as set (a reference's ratio or `auto`'s form choice
            rewrites the resolved one).
        benchmark: Threads and batch sizes the gate times at.
        sweep: The sensitivity sweep the table allocates over.
        layout: Where the latency tables are.
        model: The trained model.
        example: One input batch.
        shape: One sample's shape.
        choose: Ranks each allocation's shortlist (`PlanTrials`), or None.
        sizes: Each unit's full width (read off the model when None).
    """

    config: PruneConfig
    asked_value: float
    benchmark: BenchmarkConfig
    sweep: dict
    layout: Layout
    model: nn.Module
    example: torch.Tensor
    shape: list[int] | tuple[int, ...]
    choose: Callable | None = None
    sizes: dict[str, int] | None = None  # each unit's full width; read off the model when None
    goal: ResolvedTarget | None = None  # the target as resolved (None: as `config` asks it)
    # The steps, injected (None: the table, the measured gate and the runoff's interleaved timing):
    # `ask(aim_ms, measured points)` -> the table's plan; `measure(plan)` -> its gate's reading;
    # `retime(widths by plan name)` -> ms of dense and each, timed in one run.
    ask: Callable[[float | None, list], Plan] | None = None
    measure: Callable[[Plan], GateResult] | None = None
    retime: Callable[[dict[str, dict[str, int]]], dict[str, float]] | None = None
    key: str = field(init=False)

    def __post_init__(self) -> None:
        if self.sizes is None:
            self.sizes = unit_sizes(self.model, self.example)
        self.goal = self.goal or asked(self.config)
        self.key = str(self.goal.batch)

    def gate(self, target: Plan) -> GateResult:
        """The gate's reading of one plan."""
        if self.measure is not None:
            return self.measure(target)
        return gate_plan(self.config, self.benchmark, self.model, self.example, self.shape, target, self.goal)

    def goal_ms(self, gated: GateResult) -> float:
        """The milliseconds a plan's reading is held to, from readings in the same run.

        `latency_ms` as set; `latency_ratio` of dense, or (`prune.target.reference`) of the
        reference model as asked, no slower than the gate's `min_speedup` lets a pruned model be.
        """
        if self.goal.kind == "latency_ms":
            return self.goal.value
        if not gated.reference_ms:
            return self.goal.value * gated.dense_ms[self.key]
        return min(
            self.asked_value * gated.reference_ms[self.key], self.config.mildest_ratio * gated.dense_ms[self.key]
        )

    def fraction(self, gated: GateResult) -> float:
        """A reading as a fraction of the target: 1.0 is on it."""
        return gated.measured_ms.get(self.key, float("inf")) / self.goal_ms(gated)

    def timed_widths(self, target: Plan, gated: GateResult) -> dict[str, int]:
        """The widths that `gated.measured_ms` belong to: as the gate took them, or as planned if it refused."""
        if gated.decision is GateDecision.REFUSED:
            return planned_widths(self.config, self.sizes, target)
        return keep_counts(gated.ratios, self.sizes)

    def run(self, first: Plan, gated: GateResult) -> LoopResult:
        """Measures plans from `first` (already gated) until one lands in the band; the one kept."""
        high = LATENCY_BAND[1]
        points: list = []
        self._log_try(1, Measured(first, gated))

        def measured(plan: Plan) -> GateResult:
            reading = self.gate(plan)
            self._log_try(len(points) + 1, Measured(plan, reading))
            return reading

        def next_plan(so_far: list[tuple[Plan, GateResult]], up: bool) -> Plan | None:
            return self._next_plan([Measured(*m) for m in so_far], points, up)

        pairs = close_loop((first, gated), measured, next_plan, self.fraction, LATENCY_LOOP)
        tried, first_readings = self._runoff([Measured(*m) for m in pairs])
        # A plan the gate refused ships nothing pruned, whatever its own widths measured.
        usable = [m.gated.decision is not GateDecision.REFUSED for m in tried]
        kept = tried[kept_index([self.fraction(m.gated) for m in tried], usable, LATENCY_LOOP)]
        within = [m for m, ok in zip(tried, usable, strict=True) if ok and self.fraction(m.gated) <= high]
        records = tuple(self._record(n, m, m is kept, first_readings.get(n)) for n, m in enumerate(tried, 1))
        warning = self._not_reached(kept, tried) if not within else self._under_band(kept, len(tried))
        if warning:
            kept.plan.warnings.append(warning)
        return LoopResult(kept.plan, kept.gated, records)

    def _ask(self, aim: float | None, points: list) -> Plan:
        if self.ask is not None:
            return self.ask(aim, points)
        return targets.plan_latency(
            self.config,
            self.sweep,
            self.layout.stage_dir("latency"),
            self.benchmark.threads,
            aim_ms=aim,
            measured=points,
            choose=self.choose,
            target=self.goal,
        )

    def _aim_now(self, target: Plan, gated: GateResult) -> float | None:
        """Table milliseconds to aim a retry at where the target is a reference's time; else None.

        A reference's ratio of dense is read once at the start (`aim_at_reference`) and again by
        every gate; retries aim at the reference as the last gate read it, or the steps up from
        an aim read too low never reach a wider plan.
        """
        if not gated.reference_ms or target.dense_predicted_ms is None:
            return None
        return self.goal_ms(gated) / gated.dense_ms[self.key] * target.dense_predicted_ms

    def _next_plan(self, tried: list[Measured], points: list, up: bool) -> Plan | None:
        """The next plan not measured yet (None if there is none); `points` gains the last one's reading.

        The refit is fitted on what the table predicted, the widths as planned, not on the widths
        the gate took: rounded up to the channel block, those read faster than the table's line
        puts them, and a savings scale fitted to them makes wide plans look fast.
        """
        last = tried[-1]
        points.append(
            (
                planned_widths(self.config, self.sizes, last.plan),
                planned_ms(last.gated, self.key) / last.gated.dense_ms[self.key],
            )
        )
        aim = self._aim_now(last.plan, last.gated)
        return self._next_unmeasured(last.plan, points, [m.plan.ratios for m in tried], up, aim)

    def _next_unmeasured(self, target: Plan, points: list, seen: list, up: bool, aim: float | None) -> Plan | None:
        """The table's next plan (refitted through `points`) not in `seen`; None when there is none.

        `aim` (table milliseconds) replaces the target where it moved since the plan was made (a
        reference read again). When the refit asks for a plan already measured, it steps towards
        the target (`up`: wider), 3% at a time, from the aim or from where the last plan measured,
        whichever is further that way, to the next plan not measured: between two measured plans
        that straddle the band, the refit alone alternates between them.
        """
        retry = self._ask(aim, points)
        start = aim if aim is not None else target.aim_ms
        if retry.ratios in seen and start is not None:
            if points and target.dense_predicted_ms is not None:
                where = points[-1][1] * target.dense_predicted_ms
                start = max(start, where) if up else min(start, where)
            step = 1.03 if up else 0.97
            for _ in range(8):
                start *= step
                retry = self._ask(start, points)
                if retry.ratios not in seen:
                    break
        return None if retry.ratios in seen else retry

    def _runoff(self, tried: list[Measured]) -> tuple[list[Measured], dict[int, float]]:
        """Times again, interleaved in one run, the plans a gate read just over the target and the plan kept under it.

        Candidates: every plan the gate passed that read within `RUNOFF_TOP` of the target but
        over the band's top, and the least pruned plan under it (the anchor); nothing runs
        without a plan over the top. The runoff decides how the candidates' times compare, not
        where the target lies: each plan over the top gets the anchor's gate reading scaled by
        the two plans' runoff times, and the anchor keeps its own reading (one drifting dense
        reading in the runoff would otherwise move every candidate at once). Without an anchor,
        the readings are the runoff's, against its dense.

        Returns:
            `tried` with the candidates' readings replaced, and each candidate's first fraction
            of the target by plan number (1-based).
        """
        high = LATENCY_BAND[1]
        passed = [i for i, m in enumerate(tried) if m.gated.decision is not GateDecision.REFUSED]
        over = [i for i in passed if high < self.fraction(tried[i].gated) <= RUNOFF_TOP]
        if not over:
            return tried, {}
        under = [i for i in passed if self.fraction(tried[i].gated) <= high]
        anchor = max(under, key=lambda i: self.fraction(tried[i].gated)) if under else None
        picked = over + ([anchor] if anchor is not None else [])
        widths = {f"plan{i + 1}": keep_counts(tried[i].gated.ratios, self.sizes) for i in picked}
        reference = self.goal.reference
        ms = (self.retime or self._retime)(widths)
        first = {i + 1: self.fraction(tried[i].gated) for i in picked}
        retimed = list(tried)
        for i in over:  # the anchor keeps its gate reading; without one, `picked` is `over`
            at = None if anchor is None else (f"plan{anchor + 1}", tried[anchor].gated)
            reading = self._runoff_reading(tried[i].gated, ms, f"plan{i + 1}", at)
            retimed[i] = Measured(tried[i].plan, reading)
            logger.info(
                "latency runoff: plan %d measured %.4f ms (dense %.4f%s)%s, %.3f of the target (its gate read %.3f)",
                i + 1,
                ms[f"plan{i + 1}"],
                ms["dense"],
                f", reference {ms['reference']:.4f}" if reference else "",
                ""
                if anchor is None
                else f", {ms[f'plan{i + 1}'] / ms[f'plan{anchor + 1}']:.3f}x plan {anchor + 1}'s time",
                self.fraction(reading),
                first[i + 1],
            )
        return retimed, first

    def _retime(self, widths: dict[str, dict[str, int]]) -> dict[str, float]:
        """The runoff's timing: dense and each plan's widths, exported and timed interleaved in one run."""
        g, model = self.goal, self.model
        return targets.retime(model, self.example, self.shape, widths, g.batch, self.benchmark, g.form, g.reference)

    def _runoff_reading(
        self, g: GateResult, ms: dict[str, float], name: str, anchor: tuple[str, GateResult] | None
    ) -> GateResult:
        """A candidate's gate result with its runoff reading, scaled to the anchor's (name, gate reading) if any."""
        key, referenced = self.key, self.goal.reference is not None
        if anchor is None:
            reading, dense, ref = ms[name], ms["dense"], ms.get("reference")
        else:
            anchor_name, a = anchor
            reading = a.measured_ms[key] * ms[name] / ms[anchor_name]
            dense, ref = a.dense_ms[key], a.reference_ms.get(key) if referenced else None
        return dataclasses.replace(
            g,
            measured_ms={**g.measured_ms, key: reading},
            # Taken as planned, the planned widths' time is this reading too (else the report's
            # measured_latency_ms would keep the gate's first reading beside the runoff's).
            planned_ms={**g.planned_ms, key: reading} if g.timed_as_planned else g.planned_ms,
            dense_ms={**g.dense_ms, key: dense},
            speedups={**g.speedups, key: dense / reading},
            reference_ms={**g.reference_ms, key: ref} if referenced else g.reference_ms,
        )

    def _not_reached(self, kept: Measured, tried: list[Measured]) -> str:
        of = f" of {self.goal.reference.name}" if self.goal.reference else ""
        return (
            f"latency target {self.asked_value:g} ({self.goal.kind}{of}) at batch {self.goal.batch} "
            f"not reached: the fastest planned widths measure {kept.gated.measured_ms[self.key]:.4f} ms, "
            f"{self.fraction(kept.gated):.2f}x the target ({self._why_not_reached(tried)}); pruned that far"
        )

    def _under_band(self, kept: Measured, count: int) -> str | None:
        """Kept for want of a plan in the band, not chosen: the user asked for less pruning."""
        low, high = LATENCY_BAND
        if self.fraction(kept.gated) >= low:
            return None
        return (
            f"latency target {self.asked_value:g} ({self.goal.kind}) at batch {self.goal.batch}: "
            f"no measured plan landed in {low:g}-{high:g} of it; the least pruned plan within it measures "
            f"{self.fraction(kept.gated):.2f} of the target, so the model is pruned further than asked "
            f"({count} plans measured, prune.latency_plans lists them)"
        )

    def _why_not_reached(self, tried: list[Measured]) -> str:
        """Why no measured plan met the target: the allocation could not reach it, or the table misjudged.

        A plan the table predicted within the target that then measured over it is the table's
        error (the refit and the retries did not find a plan within it), not a limit of the sweep.
        """
        misjudged = []
        for m in tried:
            predicted = predicted_ms(m.plan, m.gated, self.key)
            if predicted is not None and predicted <= self.goal_ms(m.gated):
                misjudged.append(planned_ms(m.gated, self.key) / predicted)
        if not misjudged:
            return (
                f"the sweep's informative ratios and prune.max_unit_ratio {self.config.max_unit_ratio} allow no "
                "faster allocation"
            )
        return (
            f"{len(misjudged)} of the {len(tried)} plans measured were predicted within it by the latency table but "
            f"measured {min(misjudged):.2f}-{max(misjudged):.2f}x their predictions; prune.latency_plans lists them"
        )

    def _log_try(self, number: int, m: Measured) -> None:
        # Where a latency target landed, plan by plan: the prune stage's progress on a slow
        # machine, and how to tell a coarse staircase from a misfit table afterwards.
        predicted = predicted_ms(m.plan, m.gated, self.key)
        taken = m.gated.measured_ms[self.key]
        rounded = f"; rounded up (no slower): {taken:.4f} ms, taken" if m.gated.decision is GateDecision.WIDENED else ""
        reference = f", reference {m.gated.reference_ms[self.key]:.4f}" if m.gated.reference_ms else ""
        logger.info(
            "latency plan %d: predicted %.4f ms, measured %.4f ms at batch %s (dense %.4f%s)%s, %.3f of the target",
            number,
            float("nan") if predicted is None else predicted,
            planned_ms(m.gated, self.key),
            self.key,
            m.gated.dense_ms[self.key],
            reference,
            rounded,
            self.fraction(m.gated),
        )

    def _record(self, number: int, m: Measured, kept: bool, gate_fraction: float | None) -> dict:
        """One measured plan, as `PruneReport.latency_plans` lists it.

        A plan timed again in the runoff carries the runoff's reading, and its gate's first
        reading as `gate_fraction_of_target`. Where the gate took other widths than planned
        (rounded up, no slower), the planned ones and their time are kept beside them.
        """
        widths = self.timed_widths(m.plan, m.gated)
        planned = planned_widths(self.config, self.sizes, m.plan)
        g, key = m.gated, self.key
        return {
            "plan": number,
            "widths": widths,
            "predicted_ms": predicted_ms(m.plan, g, key),
            "measured_ms": g.measured_ms.get(key),
            "dense_ms": g.dense_ms[key],
            **({"reference_ms": g.reference_ms[key]} if g.reference_ms else {}),
            "fraction_of_target": self.fraction(g),
            "summed_isolated_drop": summed_drop(m.plan),
            "gate": g.text,
            "kept": kept,
            **({"gate_fraction_of_target": gate_fraction} if gate_fraction is not None else {}),
            **({"planned_widths": planned, "planned_ms": planned_ms(g, key)} if planned != widths else {}),
        }
