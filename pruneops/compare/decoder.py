"""`pruneops bench-decoder`: a decoder LLM's perplexity–decode-time frontier, measured in one run.

One workload (a causal LM folder, a corpus split by document, optional out-of-domain text and a
labelled file for the zero-shot check) and, for each decode-time target (a fraction of the dense
model's measured time per token at batch 1):

- **ours**: the plan with the lowest validation perplexity among the uniform shapes (depth, KV
  groups, MLP width) that a cost model fitted on timed shapes predicts to meet the target, cut
  with activation importance and least-squares reconstruction; then every precision
  (fp32, INT8 and INT4 weight-only) exported, the fastest within `quantize_tolerance` of fp32's
  validation perplexity deployed;
- **uniform width**: the MLP alone cut to the target, group L2 magnitude, no data (the
  criterion of Torch-Pruning's uniform-width LLM recipe, reimplemented here);
- **depth**: whole layers removed by block influence (ShortGPT), no recovery.

Every model is exported with onnxruntime-genai's builder, timed interleaved in one process (time
to first token at `prompt_length`, time per output token at each batch), and scored by its own
exported logits: perplexity on held-out blocks with a paired bootstrap interval against dense,
on out-of-domain text, and the zero-shot check. With `recovery_tokens`, ours is distilled from the
dense model within that budget after its cut (the cut-only model stays a row); the baselines are not.
"""

from __future__ import annotations

import logging
import shutil
import time
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field

from pruneops.core.errors import ConfigError
from pruneops.core.io import dump_json
from pruneops.data.corpus import build_corpus, read_documents, read_labelled, to_blocks
from pruneops.models.decoders import load_causal_lm
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses, zero_shot_accuracy
from pruneops.planning.decode_cost import DecoderShape, feasible_plans, shape_of
from pruneops.pruning import decoder_cuts as cuts
from pruneops.pruning.decoder_vocabulary import vocabulary_cut_copy, vocabulary_evidence
from pruneops.runtimes.genai.export import export_model as export_genai
from pruneops.runtimes.genai.generation import exported_block_losses, time_generation
from pruneops.task.causal_lm.common import PlanLoop, PlanSpace, cut_to_shape, fit_costs, time_shapes
from pruneops.timing.machine import machine_info
from pruneops.training.recovery import RecoverySettings, progress_marks, recover_

log = logging.getLogger(__name__)


class ZeroShotConfig(BaseModel):
    """A labelled file scored by comparing the likelihood of each answer after a prompt."""

    model_config = ConfigDict(extra="forbid")
    path: str
    text_column: str = "text"
    label_column: str = "label"
    prompt: str = "{text}\nAnswer:"
    answers: dict[str, str]  # the file's label -> the word the model is asked to prefer
    samples: Annotated[int, Field(ge=10, le=100_000)] = 200
    seed: int = 0


class DecoderBenchConfig(BaseModel):
    """A decoder workload: the model, its text, the targets and how everything is measured."""

    model_config = ConfigDict(extra="forbid")
    workload: str
    bench: str = "llm"
    model: str
    corpus: str
    text_column: str = "text"
    out_of_domain: str | None = None
    zero_shot: ZeroShotConfig | None = None
    block_length: Annotated[int, Field(ge=16, le=8192)] = 256
    seed: int = 0
    calibration_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    search_blocks: Annotated[int, Field(ge=1, le=100_000)] = 12
    val_blocks: Annotated[int, Field(ge=1, le=100_000)] = 24
    test_blocks: Annotated[int, Field(ge=1, le=100_000)] = 64
    ood_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    targets: Annotated[list[Annotated[float, Field(gt=0.0, lt=1.0)]], Field(min_length=1)] = [0.7]
    max_layers_dropped: Annotated[int, Field(ge=0, le=1000)] = 12
    depth_step: Annotated[int, Field(ge=1, le=1000)] = 2  # depth cuts searched: multiples of this
    kv_groups: list[Annotated[int, Field(ge=1, le=1024)]] | None = None  # KV-group counts searched; null: all
    perplexity_budget: Annotated[float, Field(gt=0.0, le=10.0)] = 0.15
    quantize_tolerance: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    precisions: list[str] = ["int8", "int4"]
    # Distillation from the dense model after ours is cut (0: none); the cut-only model stays a row.
    recovery_tokens: Annotated[int, Field(ge=0, le=10**10)] = 0
    recovery_lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    recovery_batch_blocks: Annotated[int, Field(ge=1, le=1024)] = 4
    # KL to the dense model's weight; the rest is next-token loss on the corpus (1: distillation only).
    recovery_distill_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    # bf16: recovery's forward passes under autocast (weights and optimiser fp32), as finetune.compute_dtype.
    recovery_compute_dtype: Literal["fp32", "bf16"] = "fp32"
    # A rank: LoRA adapters alone train, merged after (finetune.lora_rank); null: every weight.
    recovery_lora_rank: Annotated[int, Field(ge=1, le=65536)] | None = None
    recovery_lora_alpha: Annotated[float, Field(gt=0.0, le=1e6)] = 16.0
    # Where recovery trains, as finetune.device: cpu, or cuda / cuda:N where torch sees one.
    recovery_device: Annotated[str, Field(pattern=r"^(cpu|cuda(:[0-9]{1,2})?)$")] = "cpu"
    # Output vocabulary sizes also tried on ours once recovered (quantize.decoder_vocabulary): rows of
    # each size in fp32 and every precision; ranked on the training text, the model run on `vocabulary_blocks` of it.
    vocabulary: list[Annotated[int, Field(ge=2, le=10_000_000)]] = []
    vocabulary_blocks: Annotated[int, Field(ge=1, le=100_000)] = 96
    vocabulary_tail_groups: Annotated[int, Field(ge=1, le=1_000_000)] = 256  # quantize.decoder_tail_groups
    prompt_length: Annotated[int, Field(ge=1, le=32_768)] = 256
    new_tokens: Annotated[int, Field(ge=2, le=4096)] = 32
    batches: list[Annotated[int, Field(ge=1, le=256)]] = [1, 8]
    rounds: Annotated[int, Field(ge=1, le=100)] = 3
    threads: Annotated[int, Field(ge=1, le=256)] = 1


@dataclass
class Row:
    """One measured model."""

    name: str
    kind: str  # dense | ours | uniform width | depth
    precision: str
    shape: DecoderShape
    folder: Path
    target: float | None = None
    predicted_tpot_ms: float | None = None
    vocabulary: int | None = None  # output rows kept (null: the full vocabulary)
    figures: dict = field(default_factory=dict)


def load_bench_config(path: Path) -> DecoderBenchConfig:
    """Reads and validates a decoder bench file.

    Raises:
        ConfigError: One line naming the bad key.
    """
    from pydantic import ValidationError

    try:
        return DecoderBenchConfig.model_validate(yaml.safe_load(Path(path).read_text()))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


@dataclass
class _Data:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    search: np.ndarray
    calibration: torch.Tensor
    ood: np.ndarray | None
    zero_shot: list[tuple[str, str]]


def workload_data(config: DecoderBenchConfig, tokenizer: object) -> _Data:
    """The workload's blocks: train, validation (reported and plan search apart), test, out-of-domain."""
    splits = build_corpus(
        read_documents(config.corpus, config.text_column), tokenizer, config.block_length, seed=config.seed
    )
    ood = None
    if config.out_of_domain:
        ood = to_blocks(read_documents(config.out_of_domain, config.text_column), tokenizer, config.block_length)[0]
        ood = ood[: config.ood_blocks]
    examples: list[tuple[str, str]] = []
    if config.zero_shot:
        z = config.zero_shot
        rows = [(t, z.answers[y]) for t, y in read_labelled(z.path, z.text_column, z.label_column) if y in z.answers]
        order = np.random.default_rng(z.seed).permutation(len(rows))[: z.samples]
        examples = [rows[i] for i in order]
    log.info("corpus: %s documents, %s tokens", splits.documents, splits.tokens)
    return _Data(
        train=splits.train,
        val=splits.val[: config.val_blocks],
        test=splits.test[: config.test_blocks],
        search=splits.val[-config.search_blocks :],
        calibration=torch.as_tensor(splits.train[: config.calibration_blocks]),
        ood=ood,
        zero_shot=examples,
    )


def _cost_model(config: DecoderBenchConfig, dense, tokenizer, work: Path):
    """Times a few uniform shapes and fits the decode cost model: (model, [(shape, ms per token)])."""
    table = time_shapes(
        dense,
        tokenizer,
        work,
        max_layers_dropped=config.max_layers_dropped,
        prompt_length=config.prompt_length,
        new_tokens=config.new_tokens,
        rounds=config.rounds,
        threads=config.threads,
        seed=config.seed,
    )
    return fit_costs(table)["decode"], [(shape, timing.tpot_ms) for shape, timing in table]


def _plan_in_loop(
    config, dense, tokenizer, data: _Data, calibration, cost, target: float, dense_ms, dense_folder, work
):
    """The closed loop for one target: (kept plan's model, every plan scored, the rounds timed against dense).

    Plans are ranked on the search blocks (held out from val and test); the first round plans for
    `target` x `dense_ms` (dense as the cost table measured it).
    """
    base = shape_of(dense.config)
    space = PlanSpace(config.max_layers_dropped, tuple(config.kv_groups or ()), config.depth_step)
    prompt = np.random.default_rng(config.seed).integers(0, base.vocab, (1, config.prompt_length))
    loop = PlanLoop(
        dense, tokenizer, calibration, data.search, cost, space, dense_folder, work,
        prompt, config.new_tokens, config.rounds, config.threads,
    )  # fmt: skip
    try:
        rounds = loop.run(target, target * dense_ms)
    except ConfigError as err:
        raise ConfigError(f"bench-decoder: target {target:g}: {err}") from err
    return loop.models[rounds[-1].shape], list(loop.scored.values()), rounds


def _baselines(config, dense, calibration, cost, target_ms: float) -> dict[str, DecoderShape]:
    base = shape_of(dense.config)
    width = feasible_plans(base, cost, target_ms, 0, [base.kv_groups], min_width_fraction=1 / base.mlp_width)
    depth = next(
        (
            replace(base, layers=base.layers - d)
            for d in range(base.layers)
            if cost.predict(replace(base, layers=base.layers - d)) <= target_ms
        ),
        None,
    )
    out = {}
    if width:
        out["uniform width"] = width[0]
    if depth is not None:
        out["depth"] = depth
    return out


def _zero_shot(model, tokenizer, config: DecoderBenchConfig, examples) -> tuple[float, float, float] | None:
    if not examples:
        return None
    return zero_shot_accuracy(
        model, tokenizer, examples, config.zero_shot.prompt, sorted(set(config.zero_shot.answers.values()))
    )


def recovery_settings(config: DecoderBenchConfig) -> RecoverySettings:
    """The bench file's recovery of ours, as `recover_` takes it."""
    return RecoverySettings(
        max_tokens=config.recovery_tokens,
        batch_blocks=config.recovery_batch_blocks,
        lr=config.recovery_lr,
        distill_weight=config.recovery_distill_weight,
        seed=config.seed,
        compute_dtype=config.recovery_compute_dtype,
        device=config.recovery_device,
        lora_rank=config.recovery_lora_rank,
        lora_alpha=config.recovery_lora_alpha,
    )


def _recover(config: DecoderBenchConfig, model, dense, data: _Data) -> dict:
    """Distils the dense model into the cut one within the token budget; returns what it spent."""
    settings = recovery_settings(config)
    result = recover_(model, dense, data.train, settings, progress_marks(config.recovery_tokens, 10, log))
    return {
        "tokens": result.tokens,
        "steps": result.steps,
        "wall_s": result.wall_s,
        "lr": config.recovery_lr,
        "distill_weight": config.recovery_distill_weight,
        "compute_dtype": config.recovery_compute_dtype,
        "lora_rank": config.recovery_lora_rank,
        "trained_parameters": result.trained_parameters,
        "device": config.recovery_device,
        "first_loss": result.losses[0],
        "last_loss": result.losses[-1],
    }


def _rows_for(model, tokenizer, config, work: Path, name: str, kind: str, shape, precisions, **extra) -> list[Row]:
    folders = export_genai(model, tokenizer, work / name.replace(" ", "-"), precisions, config.threads)
    return [Row(f"{name} {p}", kind, p, shape, folder, **extra) for p, folder in folders.items()]


def _vocabulary_rows(config, model, tokenizer, data: _Data, work: Path, name: str, shape, zero, target) -> list[Row]:
    """Ours with its output vocabulary cut to each size asked (not predicted: the cost model has no vocabulary)."""
    rows = []
    evidence = vocabulary_evidence(model, data.train, config.vocabulary_blocks)
    for keep in config.vocabulary:
        trimmed, cut = vocabulary_cut_copy(model, evidence, keep, config.vocabulary_tail_groups)
        log.info("%s, vocabulary %d: tail fitted to %.3f nats (rms)", name, keep, cut.fit_rms)
        named = f"{name} vocab{keep}"
        zero[named] = _zero_shot(trimmed, tokenizer, config, data.zero_shot)
        precisions = ["fp32", *config.precisions]
        rows += _rows_for(
            trimmed, tokenizer, config, work, named, "ours", shape, precisions, target=target, vocabulary=keep
        )
    return rows


def _measure(config: DecoderBenchConfig, rows: list[Row], data: _Data, vocab: int) -> None:
    """Times every row interleaved at each batch, then scores each by its exported logits."""
    rng = np.random.default_rng(config.seed)
    folders = {row.name: row.folder for row in rows}
    for batch in config.batches:
        prompt = rng.integers(0, vocab, (batch, config.prompt_length))
        log.info("timing %d models at batch %d", len(rows), batch)
        for name, timing in time_generation(folders, prompt, config.new_tokens, config.rounds).items():
            row = next(r for r in rows if r.name == name)
            row.figures[f"ttft_b{batch}_ms"] = timing.ttft_ms
            row.figures[f"tpot_b{batch}_ms"] = timing.tpot_ms
    for row in rows:
        log.info("perplexity of %s", row.name)
        row.figures["val_nll"] = exported_block_losses(row.folder, data.val, threads=2)
        row.figures["test_nll"] = exported_block_losses(row.folder, data.test, threads=2)
        if data.ood is not None:
            row.figures["ood_nll"] = exported_block_losses(row.folder, data.ood, threads=2)
        row.figures["size_mb"] = sum(p.stat().st_size for p in row.folder.glob("model.onnx*")) / 2**20


def run_decoder_bench(config: DecoderBenchConfig, out_dir: Path, work: Path, command: str) -> dict:
    """Runs the workload and writes `<out_dir>/<bench>/<workload>/` (report.md, results.json, frontier.png).

    Args:
        config: The validated bench file.
        out_dir: Where reports go (docs/results).
        work: Scratch space for exported models (removed at the end).
        command: The command line, recorded in the report.

    Returns:
        The results written to results.json.
    """
    started = time.perf_counter()
    torch.set_num_threads(2)
    dense, tokenizer = load_causal_lm(config.model)
    data = workload_data(config, tokenizer)
    calibration = cuts.calibrate(dense, data.calibration)
    base = shape_of(dense.config)
    cost, table = _cost_model(config, dense, tokenizer, work)
    dense_ms = table[0][1]
    log.info("cost model: %s; dense %.2f ms/token", cost, dense_ms)
    zero = {"dense": _zero_shot(dense, tokenizer, config, data.zero_shot)}
    rows = _rows_for(dense, tokenizer, config, work, "dense", "dense", base, ["fp32", *config.precisions])
    plans, recovery, search_s, loops = {}, {}, {}, {}
    for target in config.targets:
        searching = time.perf_counter()
        model, tried, rounds = _plan_in_loop(
            config, dense, tokenizer, data, calibration, cost, target, dense_ms, rows[0].folder, work
        )
        plans[target], loops[str(target)] = tried, [r.record() for r in rounds]
        target_ms = rounds[-1].target_ms  # the baselines are cut to the kept plan's predicted time
        shape = rounds[-1].shape
        search_s[str(target)] = time.perf_counter() - searching  # plans cut, scored and timed
        name = f"ours {target:g}"
        extra = {"target": target, "predicted_tpot_ms": cost.predict(shape)}
        if config.recovery_tokens:
            zero[f"{name} cut only"] = _zero_shot(model, tokenizer, config, data.zero_shot)
            rows += _rows_for(
                model, tokenizer, config, work, f"{name} cut only", "ours, cut only", shape, ["fp32"], **extra
            )
            recovery[str(target)] = _recover(config, model, dense, data)
        zero[name] = _zero_shot(model, tokenizer, config, data.zero_shot)
        rows += _rows_for(model, tokenizer, config, work, name, "ours", shape, ["fp32", *config.precisions], **extra)
        rows += _vocabulary_rows(config, model, tokenizer, data, work, name, shape, zero, target)
        for kind, other in _baselines(config, dense, calibration, cost, target_ms).items():
            model = cut_to_shape(dense, other, calibration, "magnitude", False)
            name = f"{kind} {target:g}"
            zero[name] = _zero_shot(model, tokenizer, config, data.zero_shot)
            rows += _rows_for(
                model,
                tokenizer,
                config,
                work,
                name,
                kind,
                other,
                ["fp32"],
                target=target,
                predicted_tpot_ms=cost.predict(other),
            )
    _measure(config, rows, data, base.vocab)
    results = _results(config, rows, zero, cost, table, plans, base, command)
    results["recovery"] = recovery
    results["plan_search_s"] = search_s
    results["loop"] = loops
    results["wall_s"] = time.perf_counter() - started
    where = Path(out_dir) / config.bench / config.workload
    where.mkdir(parents=True, exist_ok=True)
    dump_json(results, where / "results.json")  # first: the figures survive a failure of what follows
    from pruneops.compare.decoder_report import plot_decoder_frontier, write_decoder_report

    (where / "report.md").write_text(write_decoder_report(results))
    plot_decoder_frontier(results, where / "frontier.png")
    shutil.rmtree(work, ignore_errors=True)
    return results


def _perplexity_figures(row: Row, dense: Row, key: str) -> dict:
    if key not in row.figures:
        return {}
    mine, ref = perplexity_from_losses(row.figures[key], 0), perplexity_from_losses(dense.figures[key], 0)
    ratio, low, high = paired_ratio_interval(mine, ref)
    prefix = key.removesuffix("_nll")
    return {
        f"{prefix}_ppl": mine.value,
        f"{prefix}_ppl_ci": [mine.low, mine.high],
        f"{prefix}_ratio": ratio,
        f"{prefix}_ratio_ci": [low, high],
    }


def _row_result(row: Row, rows: list[Row], zero: dict, batches: list[int]) -> dict:
    dense = rows[0]
    same_precision = next((r for r in rows if r.kind == "dense" and r.precision == row.precision), dense)
    out = {
        "name": row.name,
        "kind": row.kind,
        "precision": row.precision,
        "target": row.target,
        "shape": asdict(row.shape),
        "vocabulary": row.vocabulary,
        "shape_text": row.shape.describe() + ("" if row.vocabulary is None else f", vocabulary {row.vocabulary}"),
        "size_mb": row.figures["size_mb"],
    }
    for key in ("val_nll", "test_nll", "ood_nll"):
        out.update(_perplexity_figures(row, dense, key))
    for batch in batches:
        for what in ("ttft", "tpot"):
            out[f"{what}_b{batch}_ms"] = row.figures[f"{what}_b{batch}_ms"]
        out[f"speedup_b{batch}"] = dense.figures[f"tpot_b{batch}_ms"] / row.figures[f"tpot_b{batch}_ms"]
    out["speedup_b1_same_precision"] = same_precision.figures["tpot_b1_ms"] / row.figures["tpot_b1_ms"]
    if row.predicted_tpot_ms is not None and row.precision == "fp32":
        out["predicted_tpot_b1_ms"] = row.predicted_tpot_ms
        out["prediction_error"] = row.predicted_tpot_ms / row.figures["tpot_b1_ms"] - 1
    accuracy = zero.get(row.name.rsplit(" ", 1)[0]) if row.precision == "fp32" else None
    out["zero_shot"] = list(accuracy) if accuracy else None
    return out


def _deployed(results: list[dict], target: float, tolerance: float) -> dict | None:
    ours = [r for r in results if r["kind"] == "ours" and r["target"] == target]
    fp32 = next(r for r in ours if r["precision"] == "fp32" and r["vocabulary"] is None)
    within = [r for r in ours if r["val_ppl"] <= fp32["val_ppl"] * (1 + tolerance)]
    return min(within, key=lambda r: r["tpot_b1_ms"])


def _head_to_head(rows: list[Row], target: float) -> list[dict]:
    """Ours (fp32, and cut only) against each baseline at the same target: test perplexity ratio, paired."""
    out = []
    for ours in (r for r in rows if r.kind.startswith("ours") and r.target == target and r.precision == "fp32"):
        for other in (r for r in rows if r.kind in ("uniform width", "depth") and r.target == target):
            ratio, low, high = paired_ratio_interval(
                perplexity_from_losses(ours.figures["test_nll"], 0),
                perplexity_from_losses(other.figures["test_nll"], 0),
            )
            speed = other.figures["tpot_b1_ms"] / ours.figures["tpot_b1_ms"]
            out.append(
                {
                    "target": target,
                    "ours": ours.name,
                    "baseline": other.name,
                    "test_ppl_ratio": ratio,
                    "ci": [low, high],
                    "ours_faster_by": speed,
                    "lower_beyond_interval": high < 1.0,
                }
            )
    return out


def _results(config, rows: list[Row], zero, cost, table, plans, base: DecoderShape, command: str) -> dict:
    results = [_row_result(row, rows, zero, config.batches) for row in rows]
    deployed = {t: _deployed(results, t, config.quantize_tolerance) for t in config.targets}
    within = [d for d in deployed.values() if d and d["val_ratio"] <= 1 + config.perplexity_budget]
    selected = min(within, key=lambda r: r["tpot_b1_ms"]) if within else None
    return {
        "workload": config.workload,
        "command": command,
        "machine": machine_info(config.threads),
        "config": config.model_dump(),
        "budget_points": None,
        "selected": None,  # the classifier table's fields; a decoder's pick is `decoder_selected`
        "decoder_selected": selected,
        "deployed": {str(t): d["name"] for t, d in deployed.items()},
        "rows": results,
        "head_to_head": [h for t in config.targets for h in _head_to_head(rows, t)],
        "cost_model": {
            **asdict(cost),
            "untouchable_share": cost.untouchable_share(base),
            "output_weight_share": base.output_weights / (base.output_weights + base.layer_weights),
        },
        "latency_table": [
            {"shape": s.describe(), "layer_weights": s.layer_weights, "tpot_ms": t, "predicted_ms": cost.predict(s)}
            for s, t in table
        ],
        "plans": {str(t): [{**p, "shape": p["shape"].describe()} for p in tried] for t, tried in plans.items()},
    }
