"""`quantize` stage: ONNX Runtime INT8 of the fine-tuned model, or fp32, chosen by measurement."""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import AUTO_FORM, BenchmarkConfig, PruneConfig, QuantizeConfig
from pruneops.core.errors import QualityGateError
from pruneops.core.inputs import rows
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.core.quality import DenseShips, ModelSource, QualityBudget, QualityChange, accuracy_change
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.pipeline.stages import StageReport
from pruneops.runtimes.onnxruntime.files import export_onnx_file, file_size, make_session, ort_accuracy, ort_logits
from pruneops.runtimes.onnxruntime.quantizers import QUANTIZERS, preprocess_for_quantization, weight_range

logger = logging.getLogger(__name__)


# Two median latencies within this fraction of each other are a tie: identical models timed
# interleaved agree to about 0.5 % (docs/explanation/int8.md#ties).
SAME_SPEED = 0.01


@dataclass(frozen=True)
class QuantizeReport(StageReport):
    """The chosen model (INT8, or fp32 where no INT8 form is faster) and every candidate's figures."""

    method: str
    precision: str
    fp32_val_accuracy: float
    val_accuracy: float
    test_accuracy: float
    fp32_test_accuracy: float
    latency_ms_b1: float
    fp32_latency_ms_b1: float
    size_bytes: int
    candidates: dict
    warnings: tuple[str, ...]
    static_weight_bits: str
    model_path: Path
    # What ships: the pruned model, or dense where no form of the pruned one within the budget is faster.
    source: ModelSource = ModelSource.PRUNED
    dense_ships: DenseShips | None = None  # why dense ships (None: the pruned model does)
    fastest_dense: str | None = None  # dense's fastest form within the budget (None: none is)
    dense_candidates: dict | None = None  # dense's forms, timed with the candidates (None: they are dense's)
    budget: str = "none"  # prune.gate's quality budget, as text
    val_change: dict | None = None  # the shipped model's `QualityChange` against dense fp32 on validation

    def summary(self) -> str:
        shipped = self.method if self.source is ModelSource.PRUNED else f"dense {self.method} ({self.dense_ships.why})"
        return (
            f"{shipped}: test accuracy {100 * self.test_accuracy:.2f}% "
            f"(fp32 {100 * self.fp32_test_accuracy:.2f}%), batch-1 {self.latency_ms_b1:.4f} ms "
            f"(fp32 {self.fp32_latency_ms_b1:.4f} ms) -> {self.model_path}"
        )


def _measure_candidates(
    groups: dict[str, dict[str, Path]], val, config: QuantizeConfig, batch_sizes: list[int]
) -> dict[str, dict[str, dict]]:
    """Median latency per batch size of every model of every group, timed interleaved, then accuracy and size.

    The groups are the pruned model's forms and dense's: all are timed in one session, so that a
    pruned form and the dense form it must beat meet the same machine. Every batch size the
    benchmark serves is measured, not only batch 1: dynamic INT8 can win at batch 1 and lose at
    batch 16 (a ViT here did), and that model would then ship slower than fp32 where it is used
    (docs/explanation/int8.md#every-batch). Larger batches get fewer repeats (each run is longer
    and steadier). With `fp32` among a group's candidates, a candidate measured slower than it
    (beyond a tie, `SAME_SPEED`) at some batch size is not evaluated on validation
    (`val_accuracy` None, `not_evaluated` says why): `_choose` never ships it, fp32 being within
    tolerance and not slower. Where some candidate reads slower than its group's fp32, that batch
    size is timed once more and each candidate keeps its faster reading (`timed_twice_at` lists
    those batch sizes).
    """
    from pruneops.runtimes.onnxruntime.timing import measure_latencies

    keys = [(g, n) for g, paths in groups.items() for n in paths]
    sessions = {(g, n): make_session(groups[g][n], config.threads) for g, n in keys}
    rounds = 4
    per_round = max(1, config.latency_repeats // rounds)
    latency: dict[tuple[str, str], dict[str, float]] = {k: {} for k in keys}
    retimed: list[str] = []
    for b in batch_sizes:
        repeats = per_round if b == 1 else max(5, int(per_round / b**0.5))
        timing = BenchmarkConfig(batch_sizes=[b], warmup=10 if b == 1 else 3, repeats=repeats, rounds=rounds)

        def medians(timing: BenchmarkConfig = timing, b: int = b) -> dict[tuple[str, str], float]:
            samples = measure_latencies(sessions, val.x, timing)
            return {k: float(np.median(samples[k][b])) for k in keys}

        at_b = medians()
        if any((g, "fp32") in at_b and _slower(ms, at_b[g, "fp32"]) for (g, _), ms in at_b.items()):
            # A candidate read slower than fp32 is never shipped, so one noisy reading would rule it
            # out: it is timed again, and each candidate keeps its faster reading (the machine only
            # ever adds time; docs/explanation/int8.md#timed-twice).
            again = medians()
            at_b = {k: min(ms, again[k]) for k, ms in at_b.items()}
            retimed.append(f"b{b}")
        for k in keys:
            latency[k][str(b)] = at_b[k]
    if retimed:
        logger.info("quantize: a candidate read slower than fp32 at %s; timed again there", ", ".join(retimed))
    measured: dict[str, dict[str, dict]] = {g: {} for g in groups}
    for g, n in keys:
        fp32 = latency.get((g, "fp32"))
        slower = _slower_than_fp32({"latency_ms": latency[g, n]}, {"latency_ms": fp32}) if fp32 else []
        correct = None if slower else ort_logits(sessions[g, n], val.x).argmax(1) == val.y
        measured[g][n] = {
            "precision": "fp32" if n in ("fp32", "reference") else "int8",
            "val_accuracy": None if slower else float(correct.mean()),
            "correct": correct,
            "latency_ms_b1": latency[g, n]["1"],
            "latency_ms": latency[g, n],
            "size_bytes": file_size(groups[g][n]),
            **({"not_evaluated": f"slower than fp32 at {', '.join(slower)}"} if slower else {}),
            **({"timed_twice_at": retimed} if retimed else {}),
        }
    return measured


def _slower(ms: float, reference_ms: float) -> bool:
    """Whether a median latency is above a reference by more than a tie (`SAME_SPEED`)."""
    return ms > reference_ms * (1 + SAME_SPEED)


def _slower_than_fp32(candidate: dict, fp32: dict) -> list[str]:
    """The batch sizes at which a candidate is slower than fp32 (`_slower`), as 'b16 1.070x'."""
    return [
        f"b{b} {ms / fp32['latency_ms'][b]:.3f}x"
        for b, ms in candidate["latency_ms"].items()
        if _slower(ms, fp32["latency_ms"][b])
    ]


def _fastest(names: list[str], candidates: dict[str, dict]) -> str:
    """The fastest at batch 1; of those tied with it there (`SAME_SPEED`), the fastest at the largest batch.

    A ResNet-18-style model pruned here ran static INT8 at 1.002x its fp32 time at batch 1 and 0.87x
    at batch 64: batch 1 alone, by a fifth of a percent, would ship the slower model.
    """
    best = min(candidates[n]["latency_ms_b1"] for n in names)
    tied = [n for n in names if not _slower(candidates[n]["latency_ms_b1"], best)]
    largest = max(candidates[tied[0]]["latency_ms"], key=int)
    return min(tied, key=lambda n: (candidates[n]["latency_ms"][largest], candidates[n]["latency_ms_b1"]))


def _faster(candidate: dict, rival: dict) -> bool:
    """Whether `candidate` is faster than `rival` as `_fastest` ranks them.

    Faster at batch 1 beyond a tie (`SAME_SPEED`), or tied there and faster at the largest batch.
    """
    if _slower(rival["latency_ms_b1"], candidate["latency_ms_b1"]):
        return True
    if _slower(candidate["latency_ms_b1"], rival["latency_ms_b1"]):
        return False
    largest = max(candidate["latency_ms"], key=int)
    return _slower(rival["latency_ms"][largest], candidate["latency_ms"][largest])


class OutsideBudget(Exception):
    """No candidate within tolerance is within the quality budget against dense."""


def _choose(names: list[str], candidates: dict[str, dict], reference: dict) -> tuple[str, list[str]]:
    """The fastest candidate (`_fastest`) among those within tolerance and no slower than fp32 at any batch.

    "Slower" and "faster" are beyond `SAME_SPEED`, a tie. With `auto`, fp32 is a candidate and wins
    wherever every INT8 form loses somewhere. A method named in params ships as configured; if it
    measured slower than fp32, a warning says where. Only candidates within the quality budget
    against dense (`within_budget`) ship.

    Raises:
        QualityGateError: No candidate within the tolerance of fp32.
        OutsideBudget: Some within the tolerance, none within the budget.
    """
    tolerated = [n for n in names if candidates[n]["within_tolerance"]]
    eligible = [n for n in tolerated if candidates[n].get("within_budget", True)]
    if tolerated and not eligible:
        raise OutsideBudget
    if not eligible:
        figures = ", ".join(
            f"{n} {100 * (c['val_accuracy'] - reference['val_accuracy']):+.2f} pts"
            for n, c in candidates.items()
            if c["val_accuracy"] is not None
        )
        raise QualityGateError(f"no candidate within the accuracy tolerance of fp32 validation accuracy ({figures})")
    fp32 = candidates.get("fp32", reference)
    not_slower = [n for n in eligible if not _slower_than_fp32(candidates[n], fp32)]
    chosen = _fastest(not_slower or eligible, candidates)
    slower = _slower_than_fp32(candidates[chosen], fp32)
    warnings = [f"quantize.method={chosen} measured slower than fp32 at {', '.join(slower)}"] if slower else []
    return chosen, warnings


def planned_form(prune: PruneConfig, layout: Layout) -> str:
    """The form the prune stage planned its latency target in (with `auto`, the one it kept)."""
    if prune.latency_form != AUTO_FORM:
        return prune.latency_form
    allocation = layout.stage_dir("prune") / "allocation.json"
    return read_json(allocation).get("latency_form", "fp32") if allocation.is_file() else "fp32"


def _planned_in_another_form(prune: PruneConfig, planned: str, chosen: str) -> list[str]:
    """A warning where the widths were chosen for a latency timed in another form than the one that ships."""
    if not prune.latency_target or planned == chosen:
        return []
    # Not a prescription: planned in another form the widths change, and so may the form that ships
    # (the default digits run planned in static INT8 cut 10x the MACs and shipped fp32). Two runs decide.
    how = (
        f"auto kept the {planned} plan before fine-tuning, and {chosen} measured faster here within tolerance"
        if prune.latency_form == AUTO_FORM
        else f"compare this run's benchmark with `dvc exp run -S prune.target.form={chosen}` (or auto)"
    )
    return [
        f"prune.target.form={prune.latency_form}: the {prune.target_kind} target was planned in {planned} "
        f"and {chosen} ships, so it holds for the {planned} model, not necessarily for the deployed one; {how}"
    ]


def quantize_model(
    config: QuantizeConfig, benchmark: BenchmarkConfig, prune: PruneConfig, layout: Layout | None = None
) -> QuantizeReport:
    """Quantizes the fine-tuned model with ONNX Runtime and keeps the fastest model within tolerance.

    Candidates (`static`, `dynamic` and `fp32` for `auto`, or the one named) are compared on
    validation accuracy and on latency at batch 1 and every `benchmark.batch_sizes`, measured
    here, interleaved; the fastest at batch 1 whose validation accuracy is within
    `accuracy_tolerance` of fp32 and that is no slower than fp32 at any of those batch sizes is
    kept, where medians within `SAME_SPEED` are a tie (the largest batch then decides). fp32 is
    always a candidate of `auto`, so INT8 ships only where it is not slower on this machine. Test
    accuracy is measured on the chosen model. Where the prune stage planned a
    latency target in another form than the one chosen here, a warning says so.

    Dense is exported in the same forms and timed in the same session, and chosen by the same rules:
    its pick is the fastest form a user gets without pruning. The quality budget
    (`prune.gate.max_accuracy_drop`): a candidate ships only if its validation accuracy against
    dense fp32 is within the budget at the far end of its 95 % paired interval. Where no form of
    the pruned model is, or where the pruned pick is no faster (`_faster`) than dense's pick, dense's
    pick ships and a warning gives the figures (`dense_ships` names which). `dense.onnx` is dense in
    the form that ships (the benchmark's row of the same precision), `dense_fastest.onnx` dense's pick.

    Args:
        config: The `quantize` section.
        benchmark: The `benchmark` section: the batch sizes the chosen model must not lose at.
        prune: The `prune` section: the form its latency target was timed in, the quality budget.
        layout: Where the stage reads and writes.

    Raises:
        QualityGateError: No candidate is within the accuracy tolerance.
    """
    layout = layout or Layout()
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    model = load_checkpoint(layout.stage_dir("finetune") / "model.safetensors").model
    dense = load_checkpoint(layout.stage_dir("train") / "model.safetensors").model
    names = QUANTIZERS.names() if config.method == "auto" else [config.method]
    budget = prune.gate.budget("classification")
    rng = np.random.default_rng(0)
    calib = rows(train.x, rng.choice(len(train), min(config.calibration_samples, len(train)), replace=False))
    work = Path(tempfile.mkdtemp(prefix="pruneops-quant-"))
    try:
        # Dense passed on unchanged (a dense variant): its forms are the candidates, timed once, with no rival.
        group = ModelSource.PRUNED if _same_weights(model, dense) else ModelSource.DENSE  # holds dense's forms
        models = {ModelSource.PRUNED: model, ModelSource.DENSE: dense}
        forms = {
            g: _forms(models[g], meta.input_shape, names, calib, config, work / g, reference=True)
            for g in dict.fromkeys([ModelSource.PRUNED, group])
        }
        measured = _measure_candidates(forms, val, config, sorted({1, *benchmark.batch_sizes}))
        dense_correct = measured[group].get("reference", measured[group].get("fp32"))["correct"]
        pruned, reference = _judged(measured[ModelSource.PRUNED], config, dense_correct, budget)
        dense_candidates, dense_reference, rival = None, reference, None
        if group is ModelSource.DENSE:
            dense_candidates, dense_reference = _judged(measured[ModelSource.DENSE], config, dense_correct, budget)
            rival = _rival(names, dense_candidates, dense_reference)
        try:
            chosen, warnings = _choose(names, pruned, reference)
        except QualityGateError as e:
            raise QualityGateError(f"quantize.accuracy_tolerance={config.accuracy_tolerance}: {e}") from None
        except OutsideBudget:
            chosen, warnings = None, []
        dense_ships = _dense_ships(pruned, chosen, dense_candidates, rival, budget)
        source, candidates, paths = ModelSource.PRUNED, pruned, forms[ModelSource.PRUNED]
        if dense_ships is not None:
            if rival is None:  # a quantizer named in params: dense in it is outside the budget too
                raise QualityGateError(f"{dense_ships[1]}; dense in {config.method} is outside it too")
            source, (chosen, more), reference, paths = ModelSource.DENSE, rival, dense_reference, forms[group]
            warnings = [dense_ships[1], *more]
            candidates = {**{f"pruned {n}": c for n, c in pruned.items()}, **dense_candidates}
        else:
            warnings += _planned_in_another_form(prune, planned_form(prune, layout), chosen)
        fp32 = paths.get("reference", paths.get("fp32"))
        test_accuracy = ort_accuracy(make_session(paths[chosen], config.threads), test.x, test.y)
        report = QuantizeReport(
            method=chosen,
            precision=candidates[chosen]["precision"],
            fp32_val_accuracy=reference["val_accuracy"],
            val_accuracy=candidates[chosen]["val_accuracy"],
            test_accuracy=test_accuracy,
            fp32_test_accuracy=test_accuracy
            if chosen == "fp32"
            else ort_accuracy(make_session(fp32, config.threads), test.x, test.y),
            latency_ms_b1=candidates[chosen]["latency_ms_b1"],
            fp32_latency_ms_b1=reference["latency_ms_b1"],
            size_bytes=candidates[chosen]["size_bytes"],
            candidates=candidates,
            warnings=tuple(warnings),
            static_weight_bits="{} ({})".format(*_bits(config)),
            model_path=layout.stage_dir("quantize") / "model.onnx",
            source=source,
            dense_ships=dense_ships and dense_ships[0],
            fastest_dense=rival and rival[0],
            dense_candidates=dense_candidates,
            budget=budget.text(),
            val_change=candidates[chosen]["val_change"],
        )
        fastest = forms[group][rival[0]] if rival else None
        _write(layout, paths[chosen], forms[group][chosen], fastest, report)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report


def _same_weights(model: torch.nn.Module, dense: torch.nn.Module) -> bool:
    """Whether `finetune` passed dense on unchanged (a dense variant): every tensor equal, names and shapes alike."""
    mine, theirs = model.state_dict(), dense.state_dict()
    return mine.keys() == theirs.keys() and all(
        mine[k].shape == theirs[k].shape and torch.equal(mine[k], theirs[k]) for k in mine
    )


def _rival(names: list[str], candidates: dict[str, dict], reference: dict) -> tuple[str, list[str]] | None:
    """Dense's fastest form within the tolerance and the budget (`_choose`), and its warnings; None: none is."""
    try:
        return _choose(names, candidates, reference)
    except (QualityGateError, OutsideBudget):
        return None


def _dense_ships(
    candidates: dict[str, dict],
    chosen: str | None,
    dense_candidates: dict[str, dict] | None,
    rival: tuple[str, list[str]] | None,
    budget: QualityBudget,
) -> tuple[DenseShips, str] | None:
    """Why dense ships instead of `chosen` (the pruned model's pick), and the warning that says so; None: it ships.

    Dense ships where no form of the pruned model is within the budget (`chosen` None), and where the
    pick is no faster (`_faster`) than `rival`, dense's fastest form within the same budget: what the
    user gets by quantizing dense alone, timed in the same session. Shipping the pruned model there
    would be a regression.
    """
    if chosen is None:
        return DenseShips.OUTSIDE_BUDGET, _backed_off(candidates, budget)
    if rival is None or _faster(candidates[chosen], dense_candidates[rival[0]]):
        return None
    mine, theirs = candidates[chosen], dense_candidates[rival[0]]
    largest = max(mine["latency_ms"], key=int)
    return DenseShips.NOT_FASTER, (
        f"prune.gate: the fastest form of the pruned model within the {budget.text()} budget, {chosen} at "
        f"{mine['latency_ms_b1']:.4f} ms at batch 1 ({mine['latency_ms'][largest]:.4f} ms at batch {largest}), "
        f"is no faster than dense {rival[0]} at {theirs['latency_ms_b1']:.4f} ms "
        f"({theirs['latency_ms'][largest]:.4f} ms) within the same budget (a tie is within "
        f"{100 * SAME_SPEED:g} %); the dense model ships instead (a deeper cut, prune.target, or an INT8 form of the "
        "pruned model within the budget, from more finetune.epochs, would let one through)"
    )


def _forms(
    model, input_shape, names: list[str], calib, config: QuantizeConfig, work: Path, reference: bool = False
) -> dict[str, Path]:
    """ONNX files of `model` in each form named, from one fp32 export (INT8 from its pre-processed graph).

    With `reference`, the fp32 export is also there as "reference" where fp32 does not compete.
    """
    work.mkdir(parents=True)
    fp32, prepared = work / "reference.onnx", work / "prepared.onnx"
    export_onnx_file(model, input_shape, fp32, config.opset, config.exporter)
    # The fp32 candidate is the export itself: it is the reference when it competes.
    paths = {"reference": fp32} if reference and "fp32" not in names else {}
    for name in names:
        if name == "fp32":
            paths[name] = fp32
            continue
        if not prepared.exists():
            preprocess_for_quantization(fp32, prepared)
        paths[name] = work / f"candidate-{name}.onnx"
        # INT8 is made from the pre-processed graph; fp32 ships (and is compared) as exported,
        # like dense (docs/explanation/int8.md#fp32-as-exported).
        QUANTIZERS.get(name)(prepared, paths[name], calib, config)
    return paths


def _judged(measured: dict[str, dict], config: QuantizeConfig, dense_correct, budget: QualityBudget):
    """Every candidate measured, within the tolerance of its fp32 or not, its change against dense in the budget or not.

    Returns:
        The candidates (by name) and the fp32 reference's figures.
    """
    measured = {n: dict(c) for n, c in measured.items()}
    reference = measured.pop("reference") if "reference" in measured else measured["fp32"]
    candidates = {}
    for n, c in measured.items():
        correct = c.pop("correct")
        change = accuracy_change(correct, dense_correct) if correct is not None else None
        candidates[n] = {
            **c,
            "within_tolerance": c["val_accuracy"] is not None
            and reference["val_accuracy"] - c["val_accuracy"] <= config.accuracy_tolerance,
            "val_change": change.record() if change else None,
            "within_budget": change is not None and budget.holds(change),
        }
    reference.pop("correct", None)
    return candidates, reference


def _backed_off(candidates: dict[str, dict], budget) -> str:
    """The warning of a back-off to dense: what each form of the pruned model measured against the budget."""
    figures = ", ".join(
        f"{n} {QualityChange(**c['val_change']).text()}" for n, c in candidates.items() if c["val_change"] is not None
    )
    return (
        f"prune.gate.max_accuracy_drop: no form of the pruned model is within the {budget.text()} budget against "
        f"dense on validation, judged at the far end of its 95 % interval ({figures}); the dense model ships "
        "instead (a milder prune.target, or a larger budget, would let a pruned one through)"
    )


def _bits(config: QuantizeConfig) -> tuple[int, str]:
    """The static candidate's weight bits and why (`weight_range`)."""
    reduced, why = weight_range(config.reduce_range)
    return (7 if reduced else 8), why


def _write(layout: Layout, chosen: Path, dense: Path, fastest: Path | None, report: QuantizeReport) -> None:
    """The model that ships, dense in its form (`dense.onnx`), dense's fastest form within the budget, the figures."""
    out_dir, metrics_path = layout.stage_dir("quantize"), layout.metrics("quantize")
    with staged_output_paths(out_dir, metrics_path) as staged:
        tmp = staged.dir(out_dir)
        shutil.copyfile(chosen, tmp / "model.onnx")
        shutil.copyfile(dense, tmp / "dense.onnx")
        if fastest is not None:
            shutil.copyfile(fastest, tmp / "dense_fastest.onnx")
        dump_json({"selection": "fastest within tolerance on validation", **report.metrics()}, tmp / "quantize.json")
        dump_json(report.metrics(), staged.path(metrics_path))
