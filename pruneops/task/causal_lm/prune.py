"""`prune` for a causal LM: the uniform shape with the lowest search perplexity that meets the target, measured."""

from __future__ import annotations

import logging
import tempfile
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
import torch

from pruneops.config import BenchmarkConfig, DecoderCutConfig, PruneConfig
from pruneops.core.errors import ConfigError
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoders import load_causal_lm, save_causal_lm
from pruneops.models.language import block_losses, calibration_blocks, perplexity_from_losses
from pruneops.pipeline.stages import StageReport
from pruneops.planning.decode_cost import DecoderShape, LoopRound, shape_of
from pruneops.planning.target import asked as resolved_target
from pruneops.planning.target import decoder_ratio as target_ratio
from pruneops.planning.target import of_decoder
from pruneops.pruning.decoder_cuts import calibrate
from pruneops.reports.decoder_plots import plot_plans, plot_shape
from pruneops.runtimes.base import Runtime
from pruneops.task.causal_lm.common import (
    COST_FILE,
    DECODER_RUNTIMES,
    MODEL_DIR,
    UNITS,
    PlanLoop,
    PlanSpace,
    load_blocks,
    read_cost,
    read_runtimes,
    read_stage_json,
)
from pruneops.timing.generation import DecodeWorkload, time_together

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class DecoderPruneReport(StageReport):
    """The kept shape: predicted and measured time in the target's metric, validation perplexity."""

    shape: str
    metric: str
    target_ms: float
    predicted_ms: float
    dense_ms: float
    measured_ms: float
    measured_speedup: float
    val_perplexity: float
    dense_val_perplexity: float
    plans_tried: int
    plans_timed: int  # rounds of the closed loop
    target_met: bool
    layers_removed: list
    checkpoint: Path
    warnings: tuple[str, ...] = ()
    reference_of_dense: float | None = None  # prune.target.reference's time over dense's, timed here
    gate: str = "passed"  # what the measured gate did: passed, refused (dense passes on), or not gated
    loaded_config: dict | None = None  # the prune section as loaded (never rewritten)
    resolved_target: dict | None = None  # the target as planning resolved it (a fraction of dense's time)

    def summary(self) -> str:
        return (
            f"{self.shape}: {self.measured_ms:.2f} {UNITS[self.metric]} measured "
            f"({self.measured_speedup:.2f}x dense, predicted "
            f"{self.predicted_ms:.2f}), validation perplexity {self.val_perplexity:.2f} "
            f"(dense {self.dense_val_perplexity:.2f}) -> {self.checkpoint}"
        )


def reference_folder(config: PruneConfig, layout: Layout) -> tuple[Runtime, Path] | None:
    """`prune.target.reference`'s export folder (the one its model file lies in) and its runtime, or None.

    Raises:
        ConfigError: The file is missing or its folder is no runtime's export (onnxruntime-genai, GGUF).
    """
    if not config.target.reference:
        return None
    path = (layout.root / config.target.reference).resolve()
    runtime = next((r for r in DECODER_RUNTIMES.values() if path.is_file() and r.recognises(path.parent)), None)
    if runtime is None:
        raise ConfigError(
            f"prune.target.reference: {config.target.reference} is not the model.onnx of an onnxruntime-genai model "
            "folder nor the model.gguf of a llama.cpp one (a causal LM is timed against one, e.g. the one served now)"
        )
    return runtime, path.parent


def aim_at_decoder_reference(
    config: PruneConfig, benchmark: BenchmarkConfig, folders: dict[str, tuple[Runtime, Path]], prompt: np.ndarray
) -> dict:
    """Times the reference and dense interleaved in the target's metric: the ratio of dense to plan for.

    The ratio asked of the reference (`prune.target.value`) becomes a ratio of dense, at most
    1/`gate.min_speedup` (what the gate lets pass); the record says when it was held there.
    """
    metric = config.target.decoder_metric
    timings = time_together(folders, DecodeWorkload(prompt, benchmark.new_tokens, benchmark.rounds))
    ms = {name: timings[name].milliseconds(metric) for name in folders}
    of_dense = ms["reference"] / ms["dense"]
    ratio, note = config.reference_aim(of_dense)
    record = {
        "folder": str(folders["reference"][1]),
        "metric": metric,
        "reference_ms": ms["reference"],
        "dense_ms": ms["dense"],
        "reference_of_dense": of_dense,
        "planned_ratio_of_dense": ratio,
    }
    if note is not None:
        record["note"] = note
    log.info("latency target reference %s: %.3f of dense %s time: aiming at %.3f", folders["reference"], of_dense,
             metric, ratio)  # fmt: skip
    return record


def plan_space(cut: DecoderCutConfig, base: DecoderShape, layers: dict, max_dropped: int) -> tuple[PlanSpace, list]:
    """The shapes `prune.decoder.strategy` may take, and the order it removes whole layers in.

    `plan`: every depth (in `depth_step`s), KV-group count and MLP width, cut by `importance` with
    reconstruction, layers in the order the sensitivity stage measured. `uniform_width`: the MLP
    width alone, by magnitude, no reconstruction. `depth`: whole layers alone, lowest block
    influence first (ShortGPT), widths kept, no reconstruction. A baseline strategy that no
    shape of its own is predicted to bring to the target times its fastest shape (`PlanSpace.baseline`).
    """
    if cut.strategy == "uniform_width":  # as narrow as the target needs: one neuron per layer at the least
        space = PlanSpace(0, (base.kv_groups,), importance="magnitude", reconstruct=False,
                          min_width_fraction=1 / base.mlp_width, baseline=True)  # fmt: skip
        return space, layers["layer_order"]
    if cut.strategy == "depth":
        order = sorted(range(len(layers["layers"])), key=lambda i: layers["layers"][i]["block_influence"])
        space = PlanSpace(max_dropped, (base.kv_groups,), 1, "magnitude", False, order, width_cut=False, baseline=True)
        return space, order
    space = PlanSpace(max_dropped, tuple(cut.kv_groups or ()), cut.depth_step, cut.importance, cut.reconstruct,
                      layers["layer_order"])  # fmt: skip
    return space, layers["layer_order"]


def _kv_cut_timed(layout: Layout, base: DecoderShape) -> bool:
    """Whether the latency table timed a shape with fewer KV groups (it skips one its runtime cannot serve)."""
    table = read_stage_json(layout, "latency", COST_FILE)["table"]
    return base.kv_groups == 1 or any(row["layout"]["kv_groups"] < base.kv_groups for row in table)


def _calibration_blocks(dense, train: np.ndarray, cut: DecoderCutConfig, seed: int) -> np.ndarray:
    """`prune.decoder`'s calibration blocks: the corpus's, `calibration_self_fraction` of them written by dense."""
    return calibration_blocks(dense, train, cut.calibration_blocks, cut.calibration_self_fraction, seed)


def _plan_and_measure(config: PruneConfig, benchmark: BenchmarkConfig, dense, tokenizer, blocks, layout: Layout):
    """The closed loop of `prune_decoder`.

    Returns:
        Its rounds, every plan scored, the kept plan's model, the layer order, and the target as
        resolved (a fraction of dense's time; with `prune.target.reference`, the timing behind it).
    """
    metric, cut = config.target.decoder_metric, config.decoder
    cost, dense_ms = read_cost(layout, metric)
    reference = reference_folder(config, layout)
    target_ratio(config, dense_ms)  # a latency_ms target dense already meets is refused before anything is cut
    layers = read_stage_json(layout, "sensitivity", "layers.json")
    base = shape_of(dense.config)
    space, order = plan_space(cut, base, layers, int(config.max_unit_ratio * base.layers))
    if not _kv_cut_timed(layout, base):  # the planning runtime could not serve fewer KV groups (latency's log)
        space = replace(space, kv_groups=(base.kv_groups,))
    calibration = calibrate(dense, torch.as_tensor(_calibration_blocks(dense, blocks["train"], cut, config.seed)))
    prompt = np.random.default_rng(0).integers(0, base.vocab, (1, benchmark.prompt_length))
    runtime = read_runtimes(layout).planning
    with tempfile.TemporaryDirectory(prefix="pruneops-decode-gate-") as work:
        exported = runtime.export(dense, Path(work) / "dense", ["fp32"], tokenizer=tokenizer, threads=benchmark.threads)
        dense_folder = exported["fp32"]
        aim = None
        if reference is not None:
            folders = {"dense": (runtime, dense_folder), "reference": reference}
            aim = aim_at_decoder_reference(config, benchmark, folders, prompt)
        goal = of_decoder(config, dense_ms, aim)
        ratio = goal.value
        loop = PlanLoop(
            dense, tokenizer, calibration, blocks["val"][-cut.search_blocks :], cost, space, dense_folder, Path(work),
            prompt, benchmark.new_tokens, benchmark.rounds, benchmark.threads, runtime, metric,
        )  # fmt: skip
        try:
            rounds = loop.run(ratio, ratio * dense_ms)
        except ConfigError as err:
            raise ConfigError(f"prune.target: {err}; raise prune.target.value or max_unit_ratio") from err
    return rounds, list(loop.scored.values()), loop.models[rounds[-1].shape], order, goal


def _dense_as_is(config: PruneConfig, dense, layout: Layout):
    """`prune.decoder.strategy: none`: the dense model as the latency stage timed it (`_plan_and_measure`'s shape)."""
    metric = config.target.decoder_metric
    cost, dense_ms = read_cost(layout, metric)
    base = shape_of(dense.config)
    round_ = LoopRound(dense_ms, base, cost.predict(base), dense_ms, dense_ms)
    order = read_stage_json(layout, "sensitivity", "layers.json")["layer_order"]
    return [round_], [], dense, order, resolved_target(config).aiming(value=1.0, metric=metric)


def prune_decoder(config: PruneConfig, benchmark: BenchmarkConfig, layout: Layout) -> DecoderPruneReport:
    """Cuts the adopted decoder to the uniform shape with the lowest search perplexity that meets the target.

    The target is `prune.target.value` of the dense model's time in `prune.target.metric` (per
    output token, or to the first token) the latency stage measured, or (`latency_ms`) that many
    milliseconds as a fraction of the same measurement, so that the loop's check, interleaved with
    dense, holds in whatever state the machine is in. The best plan is timed
    interleaved with dense in that metric; while it measures slower than the target, a narrower
    plan is chosen and timed (`close_the_loop`, at most `LOOP_ROUNDS` plans). A target still
    missed after that is reported in the warnings; the gate then keeps the plan only if it
    measured at least `gate.min_speedup` faster (null: not gated). As for a classifier, a plan the
    gate refuses ships nothing pruned: the dense model passes on (`gate` and the warnings give the
    figures) and finetune then has nothing to recover.

    Raises:
        ConfigError: No shape is predicted to meet the target.
    """
    torch.set_num_threads(config.threads)
    dense, tokenizer = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    blocks = load_blocks(layout)
    metric = config.target.decoder_metric
    if config.decoder.strategy == "none":
        rounds, tried, model, order, goal = _dense_as_is(config, dense, layout)
    else:
        rounds, tried, model, order, goal = _plan_and_measure(config, benchmark, dense, tokenizer, blocks, layout)
    ratio, aim = goal.value, goal.provenance.get("reference")
    last = rounds[-1]
    speedup = last.dense_ms / last.measured_ms
    warnings = []
    if last.measured_ratio > ratio and config.decoder.strategy != "none":
        warnings.append(
            f"prune.target: {last.shape.describe()} measured {last.measured_ratio:.3f} of dense {metric} time, "
            f"above the target {ratio:.3g} after {len(rounds)} plans timed (no narrower plan met it)"
        )
    kept: DecoderShape = last.shape
    gate = "passed" if config.gate.min_speedup is not None else "not gated: prune.gate.min_speedup is null"
    if config.decoder.strategy == "none":
        gate = "not pruned: prune.decoder.strategy is none, the dense model passes on"
    elif config.gate.min_speedup is not None and speedup < config.gate.min_speedup:
        gate = (
            f"refused: {last.shape.describe()} measured {speedup:.2f}x faster than dense at batch 1 in {metric} time, "
            f"below {config.gate.min_speedup:.2f}x ({len(rounds)} plans timed): nothing is pruned and the dense "
            "model passes on"
        )
        warnings.append(f"prune gate {gate}")
        model, kept = dense, shape_of(dense.config)
    val = block_losses(model, blocks["val"])
    dense_val = block_losses(dense, blocks["val"])
    dropped = sorted(order[: shape_of(dense.config).layers - kept.layers])
    rows = [{**t, "step": i, "shape": t["shape"].describe()} for i, t in enumerate(tried)]
    loop = [r.record() for r in rounds]
    out, plots = layout.stage_dir("prune"), layout.plots("prune")
    with staged_output_paths(out, layout.metrics("prune"), plots) as staged:
        save_causal_lm(model, tokenizer, staged.dir(out) / MODEL_DIR)
        plan_record = {"shape": asdict(kept), "layers_removed": dropped, "plans": rows, "loop": loop, "gate": gate,
                       "pruned": kept != shape_of(dense.config), "strategy": config.decoder.strategy}  # fmt: skip
        if aim is not None:
            plan_record["reference"] = aim
        dump_json(plan_record, staged.dir(out) / "plan.json")
        dump_json(rows, staged.dir(plots) / "history.json")
        plot_plans(rows, kept.describe(), staged.path(plots) / "history.png", UNITS[metric])
        plot_shape(asdict(shape_of(dense.config)), asdict(kept), staged.path(plots) / "allocation.png")
        report = DecoderPruneReport(
            shape=kept.describe(),
            metric=metric,
            target_ms=rounds[0].target_ms,
            predicted_ms=last.predicted_ms,
            dense_ms=last.dense_ms,
            measured_ms=last.measured_ms,
            measured_speedup=speedup,
            val_perplexity=perplexity_from_losses(val, 0).value,
            dense_val_perplexity=perplexity_from_losses(dense_val, 0).value,
            plans_tried=len(tried),
            plans_timed=len(rounds),
            target_met=not warnings,
            layers_removed=dropped,
            checkpoint=out / MODEL_DIR,
            warnings=tuple(warnings),
            reference_of_dense=aim["reference_of_dense"] if aim else None,
            gate=gate,
            loaded_config=config.model_dump(mode="json"),
            resolved_target=goal.record(),
        )
        dump_json(report.metrics(), staged.path(layout.metrics("prune")))
    return report
