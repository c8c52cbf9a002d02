"""`prune` stage: plan per-unit widths for the target, gate them on measured latency, prune iteratively.

The plan comes from `pruneops.planning.targets` (ratio, MAC/parameter budget, or latency from the
table the latency stage measured). For structured methods the planned widths are measured against
dense before any training is spent on them, and the stage backs off when they are not faster
(`prune.gate.min_speedup`): a slower model never leaves it. A latency target is closed on measurements
by `pruneops.planning.loop.LatencyLoop`.
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pruneops.config import AUTO_FORM, BenchmarkConfig, ComputeConfig, PruneConfig
from pruneops.core.errors import DataError
from pruneops.core.inputs import head_tensors
from pruneops.core.integrity import file_sha256
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.data import load_prepared
from pruneops.models.checkpoint import check_recorded_accuracy, load_checkpoint, save_checkpoint
from pruneops.pipeline.compute import open_backend
from pruneops.pipeline.stages import StageReport
from pruneops.planning.loop import (
    LatencyLoop,
    ReferenceAim,
    aim_at_reference,
    gate_plan,
    planned_ms,
    predicted_ms,
    summed_drop,
)
from pruneops.planning.recipe import make_context, prune
from pruneops.planning.target import ResolvedTarget
from pruneops.planning.target import asked as resolved_target
from pruneops.planning.targets import GateDecision, GateResult, Plan, choose_latency_form, plan
from pruneops.planning.trials import PlanTrials, trial_records
from pruneops.pruning.masks import save_masks
from pruneops.pruning.methods import METHODS
from pruneops.pruning.report import layer_shapes, sparsity_report
from pruneops.pruning.vocabulary import trim_vocabulary
from pruneops.reports.plots import plot_history, plot_sensitivity
from pruneops.training.fit import evaluate

logger = logging.getLogger(__name__)


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
    # prune.target.form auto: each form's plan (target in that form, predicted ms, summed drop) and
    # which was kept; `latency_form` is the kept one, `target_value` the target as set.
    form_choice: tuple[dict, ...] | None = None
    # A latency target: every plan the closed loop measured (widths, predicted and measured ms,
    # fraction of the target, summed isolated drop) and which was kept, so that a plan cut deeper
    # than a first one can be told apart from timing noise afterwards.
    latency_plans: tuple[dict, ...] | None = None
    # prune.trials.count: each plan trained briefly to rank an allocation's shortlist (widths,
    # summed isolated drop, validation accuracy after the trial), and whether it was measured and kept.
    plan_trials: tuple[dict, ...] | None = None
    # prune.target.reference: the file, its time and dense's when the stage began, the ratio of
    # dense planned from them, and its time beside the kept plan's in the gate's run.
    reference: dict | None = None
    # The prune section as loaded (never rewritten), and the target as planning resolved it.
    loaded_config: dict | None = None
    resolved_target: dict | None = None

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


def _resolve_form(
    config: PruneConfig, goal: ResolvedTarget, sweep: dict | None, layout: Layout, benchmark: BenchmarkConfig
) -> tuple[ResolvedTarget, list[dict] | None]:
    """The target to plan: with `target.form: auto`, in the form (and at the value in it) whose plan is cheapest.

    Without a latency target (or a sweep to plan it from) there is nothing to choose between:
    the gate times fp32 (as `goal` already says).
    """
    if config.latency_form != AUTO_FORM or not config.latency_target or sweep is None:
        return goal, None
    chosen, choices = choose_latency_form(config, sweep, layout.stage_dir("latency"), benchmark.threads, goal)
    for c in choices:
        if "screened" in c:
            logger.info("latency form %s: %s", c["form"], c["screened"])
            continue
        logger.info(
            "latency form %s: target %.4g (%s), predicted %.4f ms of %.4f dense, summed drop %s%s",
            c["form"],
            c["target_value"],
            config.target_kind,
            c["predicted_ms"],
            c["dense_predicted_ms"],
            "n/a (target not reached)" if c["summed_drop"] is None else f"{c['summed_drop']:.4f}",
            " <- kept" if c["chosen"] else "",
        )
    return chosen, choices


def prune_iteratively(
    config: PruneConfig, benchmark: BenchmarkConfig, layout: Layout | None = None, compute: ComputeConfig | None = None
) -> PruneReport:
    """Plans the target, gates the plan on measured latency, then prunes step by step with fine-tuning.

    Args:
        config: The `prune` section of params.
        benchmark: The `benchmark` section: thread count and batch sizes the gate measures at.
        layout: Where to read and write; defaults to the current directory.
        compute: The `compute` section: where plan trials train (the gate's timing stays here).

    Returns:
        The report; the pruned checkpoint (and masks, for unstructured methods) are under
        `artifacts/prune/`, the per-step history under `plots/prune/`.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    base_path = layout.stage_dir("train") / "model.safetensors"
    ckpt = load_checkpoint(base_path, fits=meta)
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

    # The target resolved once (planning.target): the loaded config is never rewritten.
    goal = resolved_target(config)
    reference = aim_at_reference(config, benchmark, layout, model, meta.input_shape) if method_cls.structured else None
    if reference is not None:  # (config validation refuses a latency target for unstructured methods)
        goal = reference.resolved(config)
    goal, form_choice = _resolve_form(config, goal, sweep, layout, benchmark)
    tried = config.trial_count > 1
    with open_backend(compute if tried else None, layout.root, config.threads) as backend:
        trials = PlanTrials(config, model, make_method, example, train, val, backend) if tried else None
        latency_dir, shape = layout.stage_dir("latency"), meta.input_shape
        target = plan(config, sweep, model, make_method, shape, latency_dir, benchmark.threads, trials, goal)
        gated = gate_plan(config, benchmark, model, example, shape, target, goal) if method_cls.structured else None
        plans = None
        if target.target_ms is not None and gated is not None:
            loop = LatencyLoop(config, goal.asked, benchmark, sweep, layout, model, example, shape, trials, goal=goal)
            kept = loop.run(target, gated)
            target, gated, plans = kept.plan, kept.gated, kept.records
    ratios = gated.ratios if gated is not None else target.ratios
    # Before the steps: fine-tuning then updates (and Adam keeps state for) only the rows kept.
    vocabulary = trim_vocabulary(model, layout, train, val, test, val_accuracy) if config.trim_vocabulary else None
    notes = list(target.warnings)
    if reference is not None and "note" in reference.record:
        notes.append(f"prune.target.reference: {reference.record['note']}")
    if gated is not None and gated.warns:
        notes.append(f"prune gate {gated.text}")
    planned = (target.ratio, ratios)
    pruned = prune(
        model, config, train, val, planned=planned, shared=shared, warnings=notes, input_shape=meta.input_shape
    )
    method, history = pruned.method, pruned.history
    report = dataclasses.replace(
        _report(config, goal, target, gated, history, method, layout),
        loaded_config=config.model_dump(mode="json"),
        resolved_target=goal.record(),
        vocabulary=vocabulary,
        form_choice=tuple(form_choice) if form_choice else None,
        latency_plans=plans,
        plan_trials=trial_records(trials, plans),
        reference=_reference_record(reference, gated),
    )
    _write(layout, config, goal, ckpt, model, method, sweep, target, ratios, history, report, meta.input_shape)
    return report


def _reference_record(reference: ReferenceAim | None, gated: GateResult | None) -> dict | None:
    """What `prune.target.reference` measured: at the start, and beside the kept plan (per batch size)."""
    if reference is None:
        return None
    if gated is None or gated.decision is GateDecision.REFUSED:
        return reference.record  # refused: dense passes on, and the widths measured are not what ships
    speedups = {b: gated.reference_ms[b] / gated.measured_ms[b] for b in gated.reference_ms}
    return {**reference.record, "ms": dict(gated.reference_ms), "speedups_over_reference": speedups}


def _report(config, goal: ResolvedTarget, target: Plan, gated: GateResult | None, history, method, layout: Layout):
    final, first = history[-1], history[0]
    measured = predicted = error = None
    if gated is not None and target.predicted_ms is not None:
        batch = str(goal.batch)
        measured = planned_ms(gated, batch)  # the error is the table's, on the widths it predicted
        predicted = predicted_ms(target, gated, batch)
        error = predicted / measured - 1.0 if measured and predicted is not None else None
    return PruneReport(
        method=config.method,
        target=config.target_kind,
        target_value=config.target.value if config.target is not None else None,
        target_batch=config.target.batch if config.target is not None else None,
        target_ratio=target.ratio,
        achieved_ratio=target.allocation.achieved_ratio if target.allocation else None,
        summed_isolated_drop=summed_drop(target),
        predicted_latency_ms=predicted,
        measured_latency_ms=measured,
        latency_prediction_error=error,
        measured_speedups=gated.speedups if gated is not None else None,
        measured_ms=gated.measured_ms if gated is not None else None,
        dense_ms=gated.dense_ms if gated is not None else None,
        latency_form=goal.form,
        gate=gated.text if gated is not None else "not applied (unstructured: no dense-kernel speed-up)",
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
        warnings=tuple(method.ctx.warnings),
        checkpoint=layout.stage_dir("prune") / "model.safetensors",
    )


def _write(layout, config, goal, ckpt, model, method, sweep, target: Plan, ratios, history, report, shape) -> None:
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
                    "latency_form": goal.form,
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
            f"Pruning ({config.method}, {config.schedule}, target {config.target_kind} {report.target_value})",
            plots / "history.png",
        )
        plot_sensitivity(sweep["units"] if sweep else {}, ratios or {}, plots / "allocation.png")
