"""What the causal-LM stages share: artefact paths, the corpus blocks, cuts, exports, timing and the decode cost."""

from __future__ import annotations

import copy
import logging
import math
import shutil
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch

from pruneops.config import BenchmarkConfig
from pruneops.config.prune import DecoderMetric
from pruneops.core.errors import ConfigError, DataError, PruneOpsError
from pruneops.core.io import Layout, read_json
from pruneops.core.progress import progress
from pruneops.data.zero_shot import read_zero_shot
from pruneops.models.language import block_losses
from pruneops.planning.decode_cost import (
    DecodeCostModel,
    DecoderShape,
    LoopRound,
    close_the_loop,
    feasible_plans,
    fit_cost_model,
    shape_of,
    width_step,
)
from pruneops.pruning import decoder_cuts as cuts
from pruneops.runtimes.base import Runtime
from pruneops.runtimes.genai import RUNTIME as GENAI
from pruneops.runtimes.llamacpp import RUNTIME as LLAMACPP
from pruneops.timing.generation import DecodeWorkload, GenerationTiming, time_together

log = logging.getLogger(__name__)


CORPUS_FILE = "corpus.npz"  # validate's token blocks


MODEL_DIR = "model"  # a HuggingFace folder (train, prune, finetune) or a genai folder (quantize, export)


UNITS: dict[DecoderMetric, str] = {"decode": "ms/token", "prefill": "ms to first token"}


REFERENCE_FILE = "prompt_reference.json"  # the token-frequency reference of prompt drift


COST_FILE = "decode_cost.json"


COST_KEYS: dict[DecoderMetric, str] = {"decode": "cost", "prefill": "prefill_cost"}  # fits in COST_FILE


DENSE_KEYS: dict[DecoderMetric, str] = {"decode": "dense_tpot_ms", "prefill": "dense_ttft_ms"}


CHOICE_FILE = "precision.json"  # quantize's choice and every candidate's figures


RUNTIMES_FILE = "runtimes.json"  # train's `RuntimeChoice`


def load_zero_shot(layout: Layout) -> dict | None:
    """The zero-shot check `validate` wrote (None: `validate.zero_shot` not set)."""
    return read_zero_shot(layout.stage_dir("validate"))


# The runtimes a causal LM may be served by, in the order `auto` prefers them (the first servable
# one times the latency table and the prune loop). Imported here, not looked up by name, so that
# every causal-LM stage's DVC dependencies hold the runtime code it may run.
DECODER_RUNTIMES: dict[str, Runtime] = {runtime.name: runtime for runtime in (GENAI, LLAMACPP)}


@dataclass(frozen=True)
class RuntimeChoice:
    """The runtimes that can serve the adopted model here (`export.runtime`), resolved once by `train`.

    Attributes:
        asked: `export.runtime` (`auto`, or one runtime's name).
        servable: Those asked that serve the model's family here, in preference order.
        refused: Each asked runtime that cannot, with why (a family it cannot convert, a library not built).
    """

    asked: str
    servable: tuple[str, ...]
    refused: dict[str, str] = field(default_factory=dict)

    @property
    def runtimes(self) -> list[Runtime]:
        """The servable runtimes: every one is a candidate of `quantize`."""
        return [DECODER_RUNTIMES[name] for name in self.servable]

    @property
    def planning(self) -> Runtime:
        """The runtime the latency table and the prune loop time in (the first servable one)."""
        return DECODER_RUNTIMES[self.servable[0]]

    def describe(self) -> str:
        """`runtimes: genai, llamacpp` and, where one was refused, why."""
        refused = "".join(f"; {name} cannot: {why}" for name, why in self.refused.items())
        return f"runtimes ({self.asked}): {', '.join(self.servable)}{refused}"


def resolve_runtimes(asked: str, model: torch.nn.Module, tokenizer: object) -> RuntimeChoice:
    """Which of the runtimes asked for serve `model` here, each asked by its `cannot_serve` probe.

    Raises:
        ConfigError: None of them can (one line with each one's reason).
    """
    names = list(DECODER_RUNTIMES) if asked == "auto" else [asked]
    refused: dict[str, str] = {}
    for name in names:
        problem = DECODER_RUNTIMES[name].cannot_serve(model, tokenizer=tokenizer)
        if problem is not None:
            refused[name] = problem
    servable = tuple(name for name in names if name not in refused)
    if not servable:
        reasons = "; ".join(f"{name}: {why}" for name, why in refused.items())
        raise ConfigError(
            f"export.runtime {asked}: no runtime can serve {model.config.model_type} models here ({reasons}) "
            "(docs/reference/decoder-families.md)"
        )
    return RuntimeChoice(asked, servable, refused)


def read_runtimes(layout: Layout) -> RuntimeChoice:
    """The `RuntimeChoice` `train` wrote.

    Raises:
        DataError: `train` ran before runtimes were resolved there (rerun it).
    """
    path = layout.stage_dir("train") / RUNTIMES_FILE
    if not path.is_file():
        raise DataError(f"{path} is missing (written by an older PruneOps): rerun train")
    record = read_json(path)
    return RuntimeChoice(record["asked"], tuple(record["servable"]), dict(record["refused"]))


def load_blocks(layout: Layout) -> dict[str, np.ndarray]:
    """The corpus blocks `validate` wrote: train, val, test and, with `general_text`, general (int64, (n, length))."""
    with np.load(layout.stage_dir("validate") / CORPUS_FILE) as npz:
        splits = ("train", "val", "test", "general_val", "general")
        return {name: npz[name].astype(np.int64) for name in splits if name in npz}


def read_stage_json(layout: Layout, stage: str, name: str) -> dict:
    """A JSON file an earlier stage wrote under its artefacts."""
    return read_json(layout.stage_dir(stage) / name)


def read_cost(layout: Layout, metric: DecoderMetric) -> tuple[DecodeCostModel, float]:
    """The latency stage's cost model of `metric` and the dense model's measured time in it.

    Raises:
        DataError: The table was written before prefill was fitted (rerun the latency stage).
    """
    record = read_stage_json(layout, "latency", COST_FILE)
    if COST_KEYS[metric] not in record:
        raise DataError(f"{COST_FILE}: no {metric} cost model in it (written by an older PruneOps); rerun latency")
    return DecodeCostModel(**record[COST_KEYS[metric]]), float(record[DENSE_KEYS[metric]])


def _timed(
    artefacts: dict[str, tuple[Runtime, Path]], vocab: int, batch: int, benchmark: BenchmarkConfig, seed: int = 0
) -> dict[str, GenerationTiming]:
    """Exports of one runtime or several timed interleaved at `batch` on a random prompt (`time_together`)."""
    prompt = np.random.default_rng(seed).integers(0, vocab, (batch, benchmark.prompt_length))
    return time_together(artefacts, DecodeWorkload(prompt, benchmark.new_tokens, benchmark.rounds))


def cut_to_shape(
    dense: torch.nn.Module,
    shape: DecoderShape,
    calibration: cuts.Calibration | None,
    importance: str,
    reconstruct: bool,
    layer_order: list[int] | None = None,
) -> torch.nn.Module:
    """A copy of `dense` cut to `shape` (the dense model is left as it is)."""
    model = copy.deepcopy(dense)
    cuts.prune_to_shape_(
        model,
        shape.layers,
        shape.mlp_width,
        shape.kv_groups,
        shape.queries_per_group,
        calibration,
        importance,
        reconstruct,
        layer_order,
    )
    return model


def cut_for_timing(dense: torch.nn.Module, shape: DecoderShape) -> torch.nn.Module:
    """A copy of `dense` in `shape`, to be timed only.

    Which weights a shape keeps does not change its time, so it is cut by magnitude, and layers
    from the end, without calibration.
    """
    layers = shape_of(dense.config).layers
    return cut_to_shape(dense, shape, None, "magnitude", False, list(range(layers - 1, -1, -1)))


def timing_shapes(base: DecoderShape, max_layers_dropped: int) -> list[DecoderShape]:
    """The uniform shapes a decode cost model is fitted on: dense, shallower, narrower, both, fewer KV groups."""
    step = width_step(base.mlp_width)
    half = max(step, base.mlp_width // 2 // step * step)
    deep = max(1, base.layers - max(max_layers_dropped, 2))
    grid = [base, replace(base, layers=deep), replace(base, mlp_width=half)]
    grid.append(replace(base, layers=deep, mlp_width=half))
    if base.kv_groups > 1:
        grid.append(replace(base, kv_groups=base.kv_groups - 1))
    return grid


def fit_costs(table: list[tuple[DecoderShape, GenerationTiming]]) -> dict[DecoderMetric, DecodeCostModel]:
    """The cost model of each latency metric (decode: ms per output token; prefill: ms to first token)."""
    metrics: tuple[DecoderMetric, ...] = ("decode", "prefill")
    return {m: fit_cost_model([(shape, timing.milliseconds(m)) for shape, timing in table]) for m in metrics}


def time_shapes(
    dense: torch.nn.Module,
    tokenizer: object,
    work: Path,
    *,
    max_layers_dropped: int,
    prompt_length: int,
    new_tokens: int,
    rounds: int,
    threads: int,
    seed: int,
    runtime: Runtime,
) -> list[tuple[DecoderShape, GenerationTiming]]:
    """Times the timing shapes in `runtime` (fp32, batch 1, interleaved; each `cut_for_timing`): dense first.

    `fit_costs` fits them.
    """
    base = shape_of(dense.config)
    grid = timing_shapes(base, max_layers_dropped)
    folders = {}
    for index, shape in progress(enumerate(grid), "latency table: exporting shapes", len(grid), "shapes"):
        model = dense if shape == base else cut_for_timing(dense, shape)
        try:
            export = runtime.export(model, work / f"table{index}", ["fp32"], tokenizer=tokenizer, threads=threads)
        except PruneOpsError as exc:  # fewer KV groups only: a runtime whose loader takes no such shape
            if shape.kv_groups == base.kv_groups:
                raise
            log.warning("latency table: %s cannot serve %s (%s): plans keep every KV group", runtime.name,
                        shape.describe(), exc)  # fmt: skip
            continue
        folders[f"shape{index}"] = export["fp32"]
    prompt = np.random.default_rng(seed).integers(0, base.vocab, (1, prompt_length))
    timings = runtime.time(folders, DecodeWorkload(prompt, new_tokens, rounds))
    return [(shape, timings[f"shape{i}"]) for i, shape in enumerate(grid) if f"shape{i}" in timings]


@dataclass(frozen=True)
class PlanSpace:
    """The uniform shapes a plan may take, and how a plan is cut from the dense model."""

    max_layers_dropped: int
    kv_groups: tuple[int, ...] = ()  # empty: every count from the dense model's down to one
    depth_step: int = 1
    importance: str = "activation"
    reconstruct: bool = True
    layer_order: list[int] | None = None  # the order depth cuts remove layers (None: by block influence)
    width_cut: bool = True  # False: every plan keeps the MLP width (depth and KV groups alone)
    min_width_fraction: float = 0.125  # the narrowest MLP a plan may keep, as a fraction of dense's
    # A baseline's cut (uniform_width, depth): where no shape is predicted to meet the target, its
    # fastest predicted shape is timed and the record says the target was missed (compared, not refused).
    baseline: bool = False


@dataclass
class PlanLoop:
    """The closed loop over one dense model: plans cut and scored once, the best timed against dense.

    `run` plans for a target, exports the best plan (fp32), times it interleaved with the dense
    export at batch 1 in `metric`, and plans narrower while it misses (`close_the_loop`).
    `scored` keeps every plan scored across rounds, `models` every plan timed.
    """

    dense: torch.nn.Module
    tokenizer: object
    calibration: cuts.Calibration
    search: np.ndarray  # token blocks that rank plans, kept apart from those a report gives
    cost: DecodeCostModel
    space: PlanSpace
    dense_folder: Path  # the dense fp32 export plans are timed against
    work: Path
    prompt: np.ndarray  # (1, prompt length) token ids
    new_tokens: int
    rounds: int
    threads: int
    runtime: Runtime  # what plans are exported to and timed in (the dense folder's runtime)
    metric: DecoderMetric = "decode"
    scored: dict[DecoderShape, dict] = field(default_factory=dict)
    models: dict[DecoderShape, torch.nn.Module] = field(default_factory=dict)

    def cut(self, shape: DecoderShape) -> torch.nn.Module:
        """A copy of the dense model cut to `shape` as the plan space says."""
        s = self.space
        return cut_to_shape(self.dense, shape, self.calibration, s.importance, s.reconstruct, s.layer_order)

    def ranked(self, target_ms: float) -> list[dict]:
        """Every plan predicted to take at most `target_ms`, cut and scored once, lowest perplexity first.

        Raises:
            ConfigError: No uniform shape is predicted to take `target_ms`.
        """
        plans = self._shapes(target_ms)
        if not plans:
            raise ConfigError(
                f"no uniform shape is predicted to take {target_ms:.2f} {UNITS[self.metric]} "
                f"(the cost model's floor is {self.cost.intercept_ms:.2f} ms)"
            )
        fresh = [shape for shape in plans if shape not in self.scored]
        for shape in progress(fresh, "plan search: scoring plans", len(fresh), "plans"):
            if shape not in self.scored:
                nll = float(block_losses(self.cut(shape), self.search).mean())
                self.scored[shape] = {
                    "shape": shape,
                    "search_nll": nll,
                    "search_perplexity": math.exp(nll),
                    "predicted_ms": self.cost.predict(shape),
                }
                log.info("plan %s: search perplexity %.2f", shape.describe(), math.exp(nll))
        return sorted((self.scored[s] for s in plans), key=lambda t: t["search_nll"])

    def _shapes(self, target_ms: float) -> list[DecoderShape]:
        """Every shape of the plan space predicted to take at most `target_ms`."""
        base = shape_of(self.dense.config)
        groups = [g for g in (self.space.kv_groups or range(base.kv_groups, 0, -1)) if g <= base.kv_groups]
        return feasible_plans(
            base,
            self.cost,
            target_ms,
            self.space.max_layers_dropped,
            groups,
            depth_step=self.space.depth_step,
            min_width_fraction=self.space.min_width_fraction if self.space.width_cut else 1.0,
        )

    def measure(self, shape: DecoderShape) -> tuple[float, float]:
        """(dense ms, plan ms) in `metric`: the plan exported and timed interleaved with dense."""
        self.models[shape] = self.cut(shape)
        name = f"loop-{shape.layers}-{shape.kv_groups}-{shape.mlp_width}"
        model, work = self.models[shape], self.work / name
        folder = self.runtime.export(model, work, ["fp32"], tokenizer=self.tokenizer, threads=self.threads)["fp32"]
        workload = DecodeWorkload(self.prompt, self.new_tokens, self.rounds)
        timed = self.runtime.time({"dense": self.dense_folder, "plan": folder}, workload)
        dense_ms, plan_ms = timed["dense"].milliseconds(self.metric), timed["plan"].milliseconds(self.metric)
        log.info("loop: %s measured %.3f of dense", shape.describe(), plan_ms / dense_ms)
        shutil.rmtree(folder.parent)  # a later round's plan is timed against dense again, not this one
        return dense_ms, plan_ms

    def run(self, target_ratio: float, target_ms: float) -> list[LoopRound]:
        """The loop's rounds for `target_ratio` of dense time, the first planned for `target_ms` (cost units).

        Raises:
            ConfigError: No shape is predicted to meet the first round's target (a baseline's space
                times its fastest shape instead).
        """
        if self.space.baseline and not self._shapes(target_ms):
            fastest = min(self.cost.predict(shape) for shape in self._shapes(math.inf))
            log.warning("no %s shape is predicted to take %.3f ms: its fastest (%.3f ms) is timed", self.metric,
                        target_ms, fastest)  # fmt: skip
            target_ms = fastest
        return close_the_loop(lambda ms: self.ranked(ms)[0]["shape"], self.measure, self.cost, target_ratio, target_ms)
