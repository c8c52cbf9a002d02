"""`prune` stage: plan per-unit widths for the target, gate them on measured latency, prune iteratively.

The plan comes from `pruneops.pruning.targets` (ratio, MAC/parameter budget, or latency from the
table the sensitivity stage measured). For structured methods the planned widths are measured
against dense before any training is spent on them, and the stage backs off when they are not
faster (`prune.min_speedup`): a slower model never leaves it.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm.auto import tqdm

from pruneops.checkpoint import check_recorded_accuracy, file_sha256, load_checkpoint, save_checkpoint
from pruneops.config import AUTO_FORM, LATENCY_TARGETS, BenchmarkConfig, PruneConfig
from pruneops.data import Split, load_prepared
from pruneops.data.text import load_tokenizer, unknown_id
from pruneops.errors import ConfigError, DataError
from pruneops.inputs import head_tensors, pad_id
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.latency import PlanOption, keep_counts
from pruneops.plots import plot_history, plot_sensitivity
from pruneops.pruning import IMPORTANCES, METHODS, SCHEDULES, PruneContext, UnitPruner, layer_shapes, sparsity_report
from pruneops.pruning.masks import save_masks
from pruneops.pruning.targets import GateResult, Plan, choose_latency_form, gate, plan
from pruneops.pruning.units import keep_count
from pruneops.pruning.vocabulary import trim_vocabulary_, unknown_fraction, used_token_ids
from pruneops.stages import StageReport
from pruneops.training import (
    Distillation,
    FitSettings,
    calibration_subset,
    evaluate,
    fit_,
    predict_logits,
    recalibrate_batchnorm_,
    with_teacher_outputs,
)

logger = logging.getLogger(__name__)

# A latency target is a ceiling: a plan is kept when its widths measure at most the target and
# no more than 5% under it (pruned further than asked costs accuracy, and a latency match that
# lands well under the other row's time compares two budgets). Was 0.85-1.05, which let a
# match land 10-15% under (ResNet family, vision, 2026-11-26). Timing noise on a gate reading
# is ~2%, so the band is wider than the noise. Four retries did not always reach it: on the
# MobileNetV2-style workload a refitted table measured 1.27, 0.74, 0.89, 0.82 and 1.00x the target
# and the 0.89 plan was kept, cut 1.7x deeper in MACs than a run whose first plan landed
# (benchmarks/latency-form.yaml, 2026-11-26); a retry costs one gate measurement, seconds here.
# The top is 1% over the target: a reading that close is the target within the noise of one
# reading. At exactly 1.0, a plan of Torch-Pruning's own widths, matched to Torch-Pruning's time,
# measured 1.001 and 1.002 of it, was refused, and the loop kept a deeper cut that trained worse
# (benchmarks/latency.yaml, CNN, 2026-11-27).
LATENCY_BAND = (0.95, 1.01)
LATENCY_RETRIES = 6
# A plan that lands in the band but more than 2% (about one timing noise) under the target leaves
# budget unspent: the loop then measures the next wider plan once, kept if it measures within the
# band. On the CNN's static-INT8 row the kept plan measured 0.96 of Torch-Pruning's time with
# a stage-2 conv of 20 where TP keeps 32, and trained 0.22 pt worse beyond noise; the table put
# TP's widths just over the target (1.024), and they measured 1.008 of it (benchmarks/latency.yaml,
# 2026-11-27).
LATENCY_REACH = 0.98
# Plans read at most this far over the target by their own gate are timed again, with the plan
# the loop would keep, in one interleaved runoff: one gate reading is noisy at the band's edge.
# Torch-Pruning's own widths, matched to Torch-Pruning's time, read 1.024 of it at the gate and
# were refused, and the loop kept a plan that trained 0.37 pt worse beyond noise; the bench's
# interleaved timing then put the two exports level, 0.129 against 0.130 ms (benchmarks/latency.yaml,
# CNN, fp32 row, 2026-11-27).
RUNOFF_TOP = 1.05
TRIAL_BN_SAMPLES = 1024  # training images a trial's pruned copy re-estimates BatchNorm on
TRIAL_EVIDENCE = 2.0  # standard errors by which a trial must beat the allocation's own plan to replace it


@dataclass
class PlanTrials:
    """Ranks a latency allocation's shortlist by brief training (`prune.plan_trials`); each plan once.

    Each plan is pruned into a copy of the trained model by the configured method, BatchNorm is
    recalibrated, one pass over the first `prune.trial_samples` training samples trains it (the
    prune stage's lr and batch size, one seed for every plan, so that the plans differ only in their
    widths), and its validation accuracy ranks it: NetAdapt's short-term fine-tuning. On the MNIST
    workloads 3,200 samples ranked TP's uniform widths above the allocator's first choices, in the
    order four epochs of fine-tuning did, where the summed isolated drop ranked them the other way.

    The allocation's own plan (the least summed drop, first) is given up only for a plan that
    validates better by more than `TRIAL_EVIDENCE` standard errors of the paired difference on the
    same validation samples: on a few hundred samples one image decides a ranking, and a plan
    picked on that is a plan picked at random (the digits default, 2026-11-27).
    """

    config: PruneConfig
    model: torch.nn.Module
    make_method: Callable[[float, dict | None], object]
    example: torch.Tensor
    train: Split
    val: Split
    records: list[dict] = dataclasses.field(default_factory=list)
    _correct: dict[tuple, np.ndarray] = dataclasses.field(default_factory=dict)
    _calibration: np.ndarray | dict | None = None  # the same BatchNorm samples for every plan, drawn once

    def __call__(self, options: tuple[PlanOption, ...]) -> int:
        """The index of the plan to keep (see the class docstring)."""
        trained = len(self.records)
        correct = [self.correct(o) for o in options]
        best = max(range(len(options)), key=lambda i: (correct[i].mean(), -i))
        gain, error = paired_gain(correct[best], correct[0])
        chosen = best if gain > TRIAL_EVIDENCE * error else 0
        # "2u": the second plan of the shortlist, the uniform cut.
        shown = (
            f"{i + 1}{'u' if o.uniform else ''} {100 * c.mean():.2f}%"
            for i, (o, c) in enumerate(zip(options, correct, strict=True))
        )
        # The loop asks again at each step along the staircase: a shortlist tried before is not news.
        logger.log(
            logging.INFO if len(self.records) > trained else logging.DEBUG,
            "plan trials (validation accuracy): %s; best %d, %+.2f pt over 1 (standard error %.2f): planned %d",
            ", ".join(shown),
            best + 1,
            100 * gain,
            100 * error,
            chosen + 1,
        )
        return chosen

    def correct(self, option: PlanOption) -> np.ndarray:
        """Which validation samples the plan gets right after its trial (trained on first sight)."""
        key = tuple(sorted(option.widths.items()))
        if key in self._correct:
            return self._correct[key]
        started = time.perf_counter()
        twin = copy.deepcopy(self.model)
        self.make_method(max(option.ratios.values(), default=0.0), option.ratios).apply_(twin, 1.0)
        if self._calibration is None:
            self._calibration = calibration_subset(self.train.x, TRIAL_BN_SAMPLES, self.config.seed)
        recalibrate_batchnorm_(twin, self._calibration)
        settings = FitSettings(1, self.config.batch_size, self.config.lr, 1e-4, 2, self.config.seed)
        subset = self.train.head(min(self.config.trial_samples, len(self.train)))
        fit_(twin, subset, self.val, settings, desc=f"plan trial {len(self.records) + 1}")
        self._correct[key] = predict_logits(twin, self.val.x).argmax(1).numpy() == self.val.y
        self.records.append(
            {
                "trial": len(self.records) + 1,
                "widths": _unit_sizes(twin, self.example),  # as the method pruned them
                "uniform": option.uniform,
                "summed_isolated_drop": option.summed_isolated_drop,
                "val_accuracy": float(self._correct[key].mean()),
                "seconds": time.perf_counter() - started,
            }
        )
        return self._correct[key]


def paired_gain(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of `a - b` (per-sample correctness on the same samples) and its standard error."""
    d = a.astype(float) - b.astype(float)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


@dataclass(frozen=True)
class PruneReport(StageReport):
    """Where pruning ended.

    `summed_isolated_drop` is what the allocation minimised: the sum over units of the validation
    accuracy drop each chosen ratio caused alone in the sweep, before any fine-tuning. It ranks
    allocations; it is not a forecast of the final accuracy (it can exceed 1). None without one.
    The latency fields compare the table's prediction for the planned widths (anchored on dense
    measured in the same run) with their measured export (ONNX Runtime here, at
    `target_batch`, in `latency_form`); `gate` says what the measured gate did.
    """

    method: str
    target: str | None
    target_value: float | None
    target_batch: int | None
    target_ratio: float
    achieved_ratio: float | None
    summed_isolated_drop: float | None
    predicted_latency_ms: float | None
    # The widths the table predicted, measured; `measured_ms` holds the widths kept, which differ
    # where the gate rounded them up (no slower).
    measured_latency_ms: float | None
    latency_prediction_error: float | None
    measured_speedups: dict[str, float] | None
    measured_ms: dict[str, float] | None
    dense_ms: dict[str, float] | None
    latency_form: str
    gate: str
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
    vocabulary: dict | None = None  # prune.trim_vocabulary: rows kept, unknown-token rates, val accuracy
    # prune.latency_form auto: each form's plan (target in that form, predicted ms, summed drop) and
    # which was kept; `latency_form` is the kept one, `target_value` the target as set.
    form_choice: tuple[dict, ...] | None = None
    # A latency target: every plan the closed loop measured (widths, predicted and measured ms,
    # fraction of the target, summed isolated drop) and which was kept, so that a plan cut deeper
    # than a first one can be told apart from timing noise afterwards.
    latency_plans: tuple[dict, ...] | None = None
    # prune.plan_trials: each plan trained briefly to rank an allocation's shortlist (widths,
    # summed isolated drop, validation accuracy after the trial), and whether it was measured and kept.
    plan_trials: tuple[dict, ...] | None = None
    # prune.target_reference: the file, its time and dense's when the stage began, the ratio of
    # dense planned from them, and its time beside the kept plan's in the gate's run.
    reference: dict | None = None

    def summary(self) -> str:
        latency = ""
        if self.measured_speedups:
            latency = ", measured " + ", ".join(f"b{b} {s:.2f}x" for b, s in self.measured_speedups.items())
        if self.reference and "speedups_over_reference" in self.reference:
            over = self.reference["speedups_over_reference"].items()
            latency += " (over the reference: " + ", ".join(f"b{b} {s:.2f}x" for b, s in over) + ")"
        return (
            f"{self.method}: {self.mac_reduction:.2f}x fewer MACs, {self.param_reduction:.2f}x fewer params, "
            f"{100 * self.weight_zero_fraction:.1f}% zero weights, val accuracy {100 * self.val_accuracy:.2f}%"
            f"{latency}{self._vocabulary_summary()}; gate: {self.gate} -> {self.checkpoint}"
        )

    def _vocabulary_summary(self) -> str:
        v = self.vocabulary
        if not v:
            return ""
        return (
            f", vocabulary {v['rows_before']:,} -> {v['rows_after']:,} rows (unknown tokens on test "
            f"{100 * v['unknown_fraction_test_before']:.2f}% -> {100 * v['unknown_fraction_test_after']:.2f}%)"
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


def _unit_sizes(model, example) -> dict[str, int]:
    return {n: u.size for n, u in UnitPruner(model, example, IMPORTANCES.get("l2")).units().items()}


def _planned_widths(config: PruneConfig, sizes: dict[str, int], target: Plan) -> dict[str, int]:
    """The widths the method will prune to for a plan (as it rounds them)."""
    ratios = target.ratios if target.ratios is not None else dict.fromkeys(sizes, target.ratio)
    return {n: keep_count(n, s, ratios.get(n, 0.0), config.round_to) for n, s in sizes.items()}


def _gate(config: PruneConfig, benchmark: BenchmarkConfig, model, example, shape, target: Plan) -> GateResult:
    """Measures the planned widths (as the method will round them) and backs off if they are not faster."""
    sizes = _unit_sizes(model, example)
    widths = _planned_widths(config, sizes, target)
    planned = {n: 1.0 - w / sizes[n] for n, w in widths.items()}
    timing = benchmark.model_copy(update={"batch_sizes": sorted({*benchmark.batch_sizes, config.target_batch or 1})})
    widen = config.target in LATENCY_TARGETS
    reference = config.reference_file
    result = gate(
        model, example, shape, planned, sizes, config.min_speedup, timing, config.latency_form, widen, reference
    )
    if result.ratios is None:  # refused: every unit kept whole
        return dataclasses.replace(result, ratios=dict.fromkeys(sizes, 0.0))
    return result


def _timed_widths(config: PruneConfig, sizes: dict[str, int], target: Plan, gated: GateResult) -> dict[str, int]:
    """The widths that `gated.measured_ms` belong to: as the gate took them, or as planned if it refused."""
    if gated.decision.startswith("refused"):
        return _planned_widths(config, sizes, target)
    return keep_counts(gated.ratios, sizes)


def _summed_drop(target: Plan) -> float | None:
    """What the allocation minimised: a ratio or budget allocation's, else a latency plan's."""
    return target.allocation.summed_isolated_drop if target.allocation else target.summed_drop


def _planned_ms(gated: GateResult, key: str) -> float | None:
    """The widths as planned (what the table predicted), measured: the gate may have taken others."""
    return gated.planned_ms.get(key, gated.measured_ms.get(key))


def _predicted_ms(target: Plan, gated: GateResult, key: str) -> float | None:
    """The table's prediction for a plan, anchored on dense as measured with it (None without one).

    The table predicts cost relative to dense; the machine's speed drifts between the latency
    stage and the gate, so the prediction is scaled by dense as the gate measured it.
    """
    if target.predicted_ms is None or not target.dense_predicted_ms:
        return None
    return target.predicted_ms / target.dense_predicted_ms * gated.dense_ms[key]


def _mildest_ratio(config: PruneConfig) -> float:
    """The slowest a pruned model may be, as a fraction of dense: what the gate's `min_speedup` lets pass."""
    return 1.0 / config.min_speedup if config.min_speedup else 1.0


def _goal_ms(config: PruneConfig, asked: PruneConfig, gated: GateResult, key: str) -> float:
    """The milliseconds a plan's reading at batch `key` is held to, from readings in the same run.

    `latency_ms` as set; `latency_ratio` of dense, or (`prune.target_reference`) of the reference
    model as set (`asked`), no slower than the gate's `min_speedup` lets a pruned model be.
    """
    if config.target == "latency_ms":
        return config.target_value
    if not gated.reference_ms:
        return config.target_value * gated.dense_ms[key]
    return min(asked.target_value * gated.reference_ms[key], _mildest_ratio(config) * gated.dense_ms[key])


def _aim_now(config: PruneConfig, asked: PruneConfig, plan: Plan, gated: GateResult, key: str) -> float | None:
    """Table milliseconds to aim a retry at where the target is a reference's time; else None.

    A reference's ratio of dense was read once at the start (`_aim_at_reference`); the gate reads
    it again in every run. The static-INT8 export of a CNN read 0.155 of dense at the start and
    0.213 in the gate: the table, asked for 0.155, planned its narrowest widths, and the steps up
    from that aim never reached a wider plan (benchmarks/latency.yaml, 2026-11-28). So retries aim
    at the reference as the last gate read it.
    """
    if not gated.reference_ms or plan.dense_predicted_ms is None:
        return None
    return _goal_ms(config, asked, gated, key) / gated.dense_ms[key] * plan.dense_predicted_ms


def _aim_at_reference(
    config: PruneConfig, benchmark: BenchmarkConfig, layout: Layout, model, shape
) -> tuple[PruneConfig, dict | None]:
    """With `prune.target_reference`: the config to plan with, its ratio of dense as timed here now.

    The table plans in fractions of dense, so the reference and dense are timed once, interleaved,
    at the target batch (in `latency_form`; fp32 under `auto`, whose form choice converts a ratio
    of dense fp32), and the ratio asked of the reference becomes a ratio of dense; the gate then
    holds each plan to the reference's time as read in its own run (`_goal_ms`). The path is made
    absolute, so that every later timing reads the same file.

    Returns:
        The config (unchanged without a reference), and what the reference measured (None without).
    """
    from pruneops.latency import measured_latency

    if not config.target_reference:
        return config, None
    path = (layout.root / config.target_reference).resolve()
    batch = config.target_batch
    timing = benchmark.model_copy(update={"batch_sizes": [batch], "warmup": 5, "repeats": 30, "rounds": 3})
    form = "fp32" if config.latency_form == AUTO_FORM else config.latency_form
    times = measured_latency({"dense": model, "reference": path}, shape, timing, budget_s=10.0, form=form)
    of_dense = times["reference"][batch] / times["dense"][batch]
    ratio = min(config.target_value * of_dense, _mildest_ratio(config))
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
    if ratio < config.target_value * of_dense:
        # A None min_speedup cannot be formatted: that case is held to dense's own time.
        held = f"1/prune.min_speedup ({ratio:.3f})" if config.min_speedup else "dense's time (prune.min_speedup null)"
        record["note"] = f"the reference measured {of_dense:.3f} of dense: the target is held to {held} instead"
    return config.model_copy(update={"target_reference": str(path), "target_value": ratio}), record


def _log_latency_try(number: int, target: Plan, gated: GateResult, key: str, fraction: float) -> None:
    # Where a latency target landed, plan by plan: the prune stage's progress on a slow machine,
    # and how to tell a coarse staircase from a misfit table afterwards.
    predicted = _predicted_ms(target, gated, key)
    planned = _planned_ms(gated, key)
    taken = gated.measured_ms[key]
    rounded = f"; rounded up (no slower): {taken:.4f} ms, taken" if gated.decision.startswith("passed:") else ""
    reference = f", reference {gated.reference_ms[key]:.4f}" if gated.reference_ms else ""
    logger.info(
        "latency plan %d: predicted %.4f ms, measured %.4f ms at batch %s (dense %.4f%s)%s, %.3f of the target",
        number,
        float("nan") if predicted is None else predicted,
        planned,
        key,
        gated.dense_ms[key],
        reference,
        rounded,
        fraction,
    )


def _meet_measured(
    config, benchmark, sweep, layout, model, example, shape, target: Plan, gated: GateResult, choose=None, asked=None
):
    """Closes the loop on milliseconds for a latency target.

    The target is checked on measurements: `latency_ratio` against dense measured in the same
    run, `latency_ms` as is. While the planned widths measure outside `LATENCY_BAND` of the
    target (above it, or pruned further than asked, at an accuracy cost), the table's predicted
    savings are rescaled to fit every plan measured so far and the table asked again (stepping
    along the staircase past plans already measured), `LATENCY_RETRIES` times at most. A plan
    inside the band but under `LATENCY_REACH` of the target is followed by one wider plan. Of the
    plans measured, the least pruned one within the target is kept (else the fastest). Each
    plan's prediction is the one made before it was measured, so the reported prediction error
    is honest. `choose` ranks each allocation's shortlist (`PlanTrials`, or None); `asked` is the
    config as set, where a reference's ratio (`_goal_ms`) or `auto`'s form choice rewrote the target.
    """
    from pruneops.pruning.targets import plan_latency

    key = str(config.target_batch)
    sizes = _unit_sizes(model, example)

    def fraction(g: GateResult) -> float:  # of the target: 1.0 is on it
        return g.measured_ms.get(key, float("inf")) / _goal_ms(config, asked or config, g, key)

    def ask(aim: float | None, points) -> Plan:
        return plan_latency(
            config, sweep, layout.stage_dir("latency"), benchmark.threads, aim_ms=aim, measured=points, choose=choose
        )

    low, high = LATENCY_BAND
    tried, points = [(target, gated)], []
    _log_latency_try(1, target, gated, key, fraction(gated))

    def measure_next(up: bool) -> bool:  # the next plan not measured yet, measured; False if none
        nonlocal target, gated
        # The refit is fitted on what the table predicted, the widths as planned, not on the widths
        # the gate took: rounded up to the channel block (no slower), those read 0.236 of dense
        # where the table's line put them at 0.31, and the savings scale fitted to them (1.11)
        # made wide plans look fast: six plans predicted at 0.23 of dense measured 0.41-0.56
        # (MobileNetV2 at batch 64, docs/vision-2026-11-29). The planned widths read 0.255
        # against a prediction of 0.227: a scale of 0.96, and the next plans narrower.
        points.append((_planned_widths(config, sizes, target), _planned_ms(gated, key) / gated.dense_ms[key]))
        aim = _aim_now(config, asked or config, target, gated, key)
        retry = _next_unmeasured(ask, target, points, [t.ratios for t, _ in tried], up, aim)
        if retry is None:
            return False
        target, gated = retry, _gate(config, benchmark, model, example, shape, retry)
        tried.append((target, gated))
        _log_latency_try(len(tried), target, gated, key, fraction(gated))
        return True

    for _ in range(LATENCY_RETRIES):
        off = fraction(gated)
        if low <= off <= high or not measure_next(up=off < low):
            break
    if low <= fraction(gated) < LATENCY_REACH:
        measure_next(up=True)
    tried, first_readings = _runoff(config, benchmark, model, example, shape, sizes, tried, fraction)
    # A plan the gate refused ships nothing pruned, whatever its own widths measured.
    within = [t for t in tried if fraction(t[1]) <= high and not t[1].decision.startswith("refused")]
    target, gated = max(within, key=lambda t: fraction(t[1])) if within else min(tried, key=lambda t: fraction(t[1]))
    plans = tuple(
        _plan_record(n, config, sizes, t, g, key, fraction(g), t is target and g is gated, first_readings.get(n))
        for n, (t, g) in enumerate(tried, 1)
    )
    if not within:
        of = f" of {config.reference_file.name}" if config.reference_file else ""
        target.warnings.append(
            f"latency target {(asked or config).target_value:g} ({config.target}{of}) at batch {config.target_batch} "
            "not reached: "
            f"the fastest planned widths measure {gated.measured_ms[key]:.4f} ms, {fraction(gated):.2f}x the target "
            f"({_why_not_reached(config, asked or config, tried, key)}); pruned that far"
        )
    elif fraction(gated) < low:
        # Kept for want of a plan in the band, not chosen: the user asked for less pruning.
        target.warnings.append(
            f"latency target {(asked or config).target_value:g} ({config.target}) at batch {config.target_batch}: "
            f"no measured plan landed in {low:g}-{high:g} of it; the least pruned plan within it measures "
            f"{fraction(gated):.2f} of the target, so the model is pruned further than asked "
            f"({len(tried)} plans measured, prune.latency_plans lists them)"
        )
    return target, gated, plans


def _why_not_reached(config: PruneConfig, asked: PruneConfig, tried: list, key: str) -> str:
    """Why no measured plan met a latency target: the allocation could not reach it, or the table misjudged.

    A plan the table predicted within the target that then measured over it is the table's error
    (the refit and the retries did not find a plan within it), not a limit of the sweep; saying
    "no faster allocation" there sent the reader to the wrong setting.
    """
    misjudged = []
    for target, gated in tried:
        predicted = _predicted_ms(target, gated, key)
        if predicted is not None and predicted <= _goal_ms(config, asked, gated, key):
            misjudged.append(_planned_ms(gated, key) / predicted)
    if not misjudged:
        return (
            f"the sweep's informative ratios and prune.max_unit_ratio {config.max_unit_ratio} allow no faster "
            "allocation"
        )
    return (
        f"{len(misjudged)} of the {len(tried)} plans measured were predicted within it by the latency table but "
        f"measured {min(misjudged):.2f}-{max(misjudged):.2f}x their predictions; prune.latency_plans lists them"
    )


def _runoff(
    config, benchmark, model, example, shape, sizes: dict[str, int], tried: list, fraction
) -> tuple[list, dict[int, float]]:
    """Times again, interleaved in one run, the plans a gate read just over the target and the plan kept under it.

    Candidates: every plan the gate passed that read within `RUNOFF_TOP` of the target but over
    the band's top, and the least pruned plan under it (the anchor); nothing runs without a plan
    over the top. The runoff decides how the candidates' times compare, not where the target
    lies: each plan over the top gets the anchor's gate reading scaled by the two plans' runoff
    times (against the anchor's dense), and the anchor keeps its own reading. Read against the
    runoff's dense instead, one drifting dense reading moved every candidate at once: on the
    ConvNeXt-style family dense read 0.86 ms in the runoff against 0.46-0.71 at the gates, the
    anchor (0.961 at its gate) read 1.047, no candidate stayed within the target, and the loop
    kept a plan 21 % under it that lost 1.47 points (benchmarks/families.yaml, 2026-11-29).
    Without an anchor, the readings are the runoff's, against its dense.

    Returns:
        `tried` with the candidates' readings replaced, and each candidate's first fraction of the
        target by plan number (1-based).
    """
    from pruneops.pruning.targets import retime

    high, key = LATENCY_BAND[1], str(config.target_batch)
    passed = [i for i, (_, g) in enumerate(tried) if not g.decision.startswith("refused")]
    over = [i for i in passed if high < fraction(tried[i][1]) <= RUNOFF_TOP]
    if not over:
        return tried, {}
    under = [i for i in passed if fraction(tried[i][1]) <= high]
    anchor = max(under, key=lambda i: fraction(tried[i][1])) if under else None
    picked = over + ([anchor] if anchor is not None else [])
    widths = {f"plan{i + 1}": keep_counts(tried[i][1].ratios, sizes) for i in picked}
    reference = config.reference_file
    ms = retime(model, example, shape, widths, config.target_batch, benchmark, config.latency_form, reference)
    first = {i + 1: fraction(tried[i][1]) for i in picked}
    retimed = list(tried)
    # The anchor keeps its gate reading; without one, `picked` is `over`.
    for i in over:
        retimed[i] = (tried[i][0], _runoff_reading(tried[i][1], ms, f"plan{i + 1}", key, anchor, tried, reference))
        logger.info(
            "latency runoff: plan %d measured %.4f ms (dense %.4f%s)%s, %.3f of the target (its gate read %.3f)",
            i + 1,
            ms[f"plan{i + 1}"],
            ms["dense"],
            f", reference {ms['reference']:.4f}" if reference else "",
            "" if anchor is None else f", {ms[f'plan{i + 1}'] / ms[f'plan{anchor + 1}']:.3f}x plan {anchor + 1}'s time",
            fraction(retimed[i][1]),
            first[i + 1],
        )
    return retimed, first


def _runoff_reading(
    g: GateResult, ms: dict[str, float], name: str, key: str, anchor: int | None, tried: list, reference
) -> GateResult:
    """A candidate's gate result with its runoff reading at batch `key`, scaled to the anchor's gate reading if any."""
    if anchor is None:
        reading, dense = ms[name], ms["dense"]
        ref = ms.get("reference")
    else:
        a = tried[anchor][1]
        reading = a.measured_ms[key] * ms[name] / ms[f"plan{anchor + 1}"]
        dense, ref = a.dense_ms[key], a.reference_ms.get(key) if reference else None
    return dataclasses.replace(
        g,
        measured_ms={**g.measured_ms, key: reading},
        dense_ms={**g.dense_ms, key: dense},
        speedups={**g.speedups, key: dense / reading},
        reference_ms={**g.reference_ms, key: ref} if reference else g.reference_ms,
    )


def _next_unmeasured(ask, target: Plan, points, seen: list, up: bool, aim: float | None = None) -> Plan | None:
    """The table's next plan (refitted through `points`) not in `seen`; None when there is none.

    `aim` (table milliseconds) replaces the target where it moved since the plan was made (a
    reference read again). When the refit asks for a plan already measured, it steps towards the
    target (`up`: wider), 3% at a time, from the aim or from where the last plan measured,
    whichever is further that way (stepping up from an aim under that plan's own time only finds
    it again), to the next plan not measured. Between two measured plans that straddle the band,
    the refit alternated between them (vision, 2026-11-26).
    """
    retry = ask(aim, points)
    start = aim if aim is not None else target.aim_ms
    if retry.ratios in seen and start is not None:
        if points and target.dense_predicted_ms is not None:
            where = points[-1][1] * target.dense_predicted_ms
            start = max(start, where) if up else min(start, where)
        step = 1.03 if up else 0.97
        for _ in range(8):
            start *= step
            retry = ask(start, points)
            if retry.ratios not in seen:
                break
    return None if retry.ratios in seen else retry


def _trial_records(trials: PlanTrials | None, plans: tuple[dict, ...] | None) -> tuple[dict, ...] | None:
    """The plans trialled, each marked whether the loop measured it and whether it was kept."""
    if trials is None or not trials.records:
        return None
    measured = {tuple(sorted(p["widths"].items())): p for p in plans or ()}

    def mark(record: dict) -> dict:
        hit = measured.get(tuple(sorted(record["widths"].items())))
        return {**record, "measured": hit is not None, "kept": bool(hit and hit["kept"])}

    return tuple(mark(r) for r in trials.records)


def _plan_record(
    number: int,
    config: PruneConfig,
    sizes: dict[str, int],
    target: Plan,
    gated: GateResult,
    key: str,
    off: float,
    kept: bool,
    gate_fraction: float | None = None,
) -> dict:
    """One measured plan of a latency target, as `PruneReport.latency_plans` lists it.

    A plan timed again in the runoff (`_runoff`) carries the runoff's reading, and its gate's
    first reading as `gate_fraction_of_target`. Where the gate took other widths than planned
    (rounded up, no slower), the planned ones and their time are kept beside them.
    """
    widths, planned = _timed_widths(config, sizes, target, gated), _planned_widths(config, sizes, target)
    return {
        "plan": number,
        "widths": widths,
        "predicted_ms": _predicted_ms(target, gated, key),
        "measured_ms": gated.measured_ms.get(key),
        "dense_ms": gated.dense_ms[key],
        **({"reference_ms": gated.reference_ms[key]} if gated.reference_ms else {}),
        "fraction_of_target": off,
        "summed_isolated_drop": _summed_drop(target),
        "gate": gated.decision,
        "kept": kept,
        **({"gate_fraction_of_target": gate_fraction} if gate_fraction is not None else {}),
        **({"planned_widths": planned, "planned_ms": _planned_ms(gated, key)} if planned != widths else {}),
    }


def _resolve_form(
    config: PruneConfig, sweep: dict | None, layout: Layout, benchmark: BenchmarkConfig
) -> tuple[PruneConfig, list[dict] | None]:
    """The config to plan with: with `latency_form: auto`, the form (and target in it) whose plan is cheapest.

    Without a latency target (or a sweep to plan it from) there is nothing to choose between:
    the gate times fp32.
    """
    if config.latency_form != AUTO_FORM:
        return config, None
    if config.target not in LATENCY_TARGETS or sweep is None:
        return config.model_copy(update={"latency_form": "fp32"}), None
    chosen, choices = choose_latency_form(config, sweep, layout.stage_dir("latency"), benchmark.threads)
    for c in choices:
        if "screened" in c:
            logger.info("latency form %s: %s", c["form"], c["screened"])
            continue
        logger.info(
            "latency form %s: target %.4g (%s), predicted %.4f ms of %.4f dense, summed drop %s%s",
            c["form"],
            c["target_value"],
            config.target,
            c["predicted_ms"],
            c["dense_predicted_ms"],
            "n/a (target not reached)" if c["summed_drop"] is None else f"{c['summed_drop']:.4f}",
            " <- kept" if c["chosen"] else "",
        )
    return chosen, choices


def prune_iteratively(config: PruneConfig, benchmark: BenchmarkConfig, layout: Layout | None = None) -> PruneReport:
    """Plans the target, gates the plan on measured latency, then prunes step by step with fine-tuning.

    Args:
        config: The `prune` section of params.
        benchmark: The `benchmark` section: thread count and batch sizes the gate measures at.
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; the pruned checkpoint (and masks, for unstructured methods) are under
        `artifacts/prune/`, the per-step history under `plots/prune/`.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    base_path = layout.stage_dir("train") / "model.safetensors"
    ckpt = load_checkpoint(base_path)
    model, example = ckpt.model, head_tensors(val.x)
    val_accuracy = evaluate(model, val)[0]
    check_recorded_accuracy(ckpt, val_accuracy, len(val), base_path)
    sweep = load_sweep(layout, config)
    method_cls = METHODS.get(config.method)
    # The sweep's saved scores are this model's when it read the same file (DVC reruns sensitivity
    # whenever train changes; this guards a stage run out of order by hand).
    scored_here = sweep is not None and sweep.get("model_sha256") == file_sha256(base_path)
    shared = method_cls.shared_scores(
        model, make_context(config, train, example, 0.0, None), layout.stage_dir("sensitivity") if scored_here else None
    )

    def make_method(ratio: float, ratios: dict | None):
        return method_cls(make_context(config, train, example, ratio, ratios, shared))

    asked = config
    reference = None
    if method_cls.structured:  # else config validation has refused a latency target already
        config, reference = _aim_at_reference(config, benchmark, layout, model, meta.input_shape)
    config, form_choice = _resolve_form(config, sweep, layout, benchmark)
    trials = PlanTrials(config, model, make_method, example, train, val) if config.trial_count > 1 else None
    target = plan(
        config, sweep, model, make_method, meta.input_shape, layout.stage_dir("latency"), benchmark.threads, trials
    )
    gated = _gate(config, benchmark, model, example, meta.input_shape, target) if method_cls.structured else None
    plans = None
    if target.target_ms is not None and gated is not None:
        target, gated, plans = _meet_measured(
            config, benchmark, sweep, layout, model, example, meta.input_shape, target, gated, trials, asked
        )
    ratios = gated.ratios if gated is not None else target.ratios
    # Before the steps: fine-tuning then updates (and Adam keeps state for) only the rows kept.
    vocabulary = trim_vocabulary(model, layout, train, val, test, val_accuracy) if config.trim_vocabulary else None
    ctx = make_context(config, train, example, target.ratio, ratios, shared)
    ctx.warnings.extend(target.warnings)
    if reference is not None and "note" in reference:
        ctx.warnings.append(f"prune.target_reference: {reference['note']}")
    if gated is not None and gated.decision.startswith(("backed off", "refused")):
        ctx.warnings.append(f"prune gate {gated.decision}")
    method = method_cls(ctx)
    history = _prune(config, model, method, train, val, meta.input_shape)
    report = dataclasses.replace(
        _report(config, target, gated, history, method, ctx, layout),
        vocabulary=vocabulary,
        target_value=asked.target_value,
        form_choice=tuple(form_choice) if form_choice else None,
        latency_plans=plans,
        plan_trials=_trial_records(trials, plans),
        reference=_reference_record(reference, gated),
    )
    _write(layout, config, ckpt, model, method, sweep, target, ratios, history, report, meta.input_shape)
    return report


def _reference_record(reference: dict | None, gated: GateResult | None) -> dict | None:
    """What `prune.target_reference` measured: at the start, and beside the kept plan (per batch size)."""
    if reference is None or gated is None or gated.decision.startswith("refused"):
        return reference  # refused: dense passes on, and the widths measured are not what ships
    speedups = {b: gated.reference_ms[b] / gated.measured_ms[b] for b in gated.reference_ms}
    return {**reference, "ms": dict(gated.reference_ms), "speedups_over_reference": speedups}


def trim_vocabulary(
    model, layout: Layout, train: Split, val: Split, test: Split, val_accuracy: float | None = None
) -> dict:
    """Trims a text model's token embedding to the ids the training texts use; what it cost.

    Kept: every id of a real training token, the tokenizer's special tokens, the padding id and
    the unknown token, which every other id now reads as. The cost on unseen text is measured where the
    model has not trained: the unknown-token rate of validation and test texts, and validation
    accuracy, before and after.

    Args:
        model: The text model, trimmed in place.
        layout: Where the validate stage left the tokenizer.
        train: The split whose tokens are kept.
        val: Measured before and after.
        test: Its unknown-token rate is reported (its accuracy is the benchmark's to report).
        val_accuracy: The untrimmed model's val accuracy when the caller has just measured it.

    Raises:
        ConfigError: Not text data, or a tokenizer without an unknown token.
    """
    if not train.named or "input_ids" not in train.x:
        raise ConfigError("prune.trim_vocabulary: applies to text data (validate.dataset: text) only")
    tokenizer = load_tokenizer(layout.stage_dir("validate") / "tokenizer.json")
    unknown = unknown_id(tokenizer)
    if unknown is None:
        raise ConfigError("prune.trim_vocabulary: the tokenizer has no unknown token to map dropped ids to")
    # Padding fills every batch (as `encode_texts` pads, and as the model's config names it).
    pads = [pad_id(tokenizer), getattr(model.model.config, "pad_token_id", None)]
    always = [unknown, *tokenizer.get_added_tokens_decoder(), *(p for p in pads if p is not None)]
    kept = used_token_ids(train.x["input_ids"], train.x["attention_mask"], always)

    def unknown_rates(ids: np.ndarray | None) -> dict[str, float]:
        everything = np.arange(tokenizer.get_vocab_size(), dtype=np.int64) if ids is None else ids
        return {
            name: unknown_fraction(split.x["input_ids"], split.x["attention_mask"], everything, unknown)
            for name, split in (("val", val), ("test", test))
        }

    before_acc = evaluate(model, val)[0] if val_accuracy is None else val_accuracy
    before = unknown_rates(None)
    trim = trim_vocabulary_(model, kept, unknown)
    after_acc, after = evaluate(model, val)[0], unknown_rates(trim.kept_ids)
    logger.info(
        "vocabulary trimmed to the training texts' %d of %d token ids: unknown tokens on val %.2f%% -> %.2f%%, "
        "val accuracy %.2f%% -> %.2f%%",
        trim.rows_after,
        trim.rows_before,
        100 * before["val"],
        100 * after["val"],
        100 * before_acc,
        100 * after_acc,
    )
    return {
        "rows_before": trim.rows_before,
        "rows_after": trim.rows_after,
        "params_removed": (trim.rows_before - trim.rows_after) * model.model.get_input_embeddings().embedding_dim,
        **{f"unknown_fraction_{k}_before": v for k, v in before.items()},
        **{f"unknown_fraction_{k}_after": v for k, v in after.items()},
        "val_accuracy_before": before_acc,
        "val_accuracy_after": after_acc,
    }


def _prune(config: PruneConfig, model, method, train: Split, val: Split, shape) -> list[dict]:
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
    if config.distill_weight > 0 or config.hidden_distill_weight > 0:
        kd = Distillation(
            copy.deepcopy(model),
            config.distill_temperature,
            config.distill_weight,
            hidden_weight=config.hidden_distill_weight,
        )
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


def _report(config, target: Plan, gated: GateResult | None, history, method, ctx, layout: Layout) -> PruneReport:
    final, first = history[-1], history[0]
    measured = predicted = error = None
    if gated is not None and target.predicted_ms is not None:
        batch = str(config.target_batch)
        measured = _planned_ms(gated, batch)  # the error is the table's, on the widths it predicted
        predicted = _predicted_ms(target, gated, batch)
        error = predicted / measured - 1.0 if measured and predicted is not None else None
    return PruneReport(
        method=config.method,
        target=config.target,
        target_value=config.target_value,
        target_batch=config.target_batch,
        target_ratio=target.ratio,
        achieved_ratio=target.allocation.achieved_ratio if target.allocation else None,
        summed_isolated_drop=_summed_drop(target),
        predicted_latency_ms=predicted,
        measured_latency_ms=measured,
        latency_prediction_error=error,
        measured_speedups=gated.speedups if gated is not None else None,
        measured_ms=gated.measured_ms if gated is not None else None,
        dense_ms=gated.dense_ms if gated is not None else None,
        latency_form=config.latency_form,
        gate=gated.decision if gated is not None else "not applied (unstructured: no dense-kernel speed-up)",
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
        checkpoint=layout.stage_dir("prune") / "model.safetensors",
    )


def _write(layout, config, ckpt, model, method, sweep, target: Plan, ratios, history, report, shape) -> None:
    out_dir, metrics_path, plots_dir = layout.stage_dir("prune"), layout.metrics("prune"), layout.plots("prune")
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        save_checkpoint(tmp / "model.safetensors", model, ckpt.spec, {"stage": "prune", "method": config.method})
        masks = method.masks()
        if masks:
            save_masks(masks, tmp / "masks.safetensors")
        dump_json(sparsity_report(model, shape, layer_shapes(ckpt.model)), tmp / "sparsity.json")
        if sweep is not None:
            allocation = asdict(target.allocation) if target.allocation is not None else {}
            dump_json(
                {
                    "granularity": sweep["granularity"],
                    **allocation,
                    "target_ratio": target.ratio,
                    "ratios": ratios or {},
                    "predicted_ms": target.predicted_ms,
                    "target_ms": target.target_ms,
                    "latency_form": config.latency_form,
                },
                tmp / "allocation.json",
            )
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
