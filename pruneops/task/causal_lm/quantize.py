"""`quantize` for a causal LM: every precision (and output vocabulary) exported, the fastest within tolerance ships."""

from __future__ import annotations

import hashlib
import json
import logging
import shutil
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import BenchmarkConfig, PruneConfig, QuantizeConfig
from pruneops.config.prune import DecoderMetric
from pruneops.core.integrity import folder_manifest
from pruneops.core.io import Layout, dump_json, replaced_whole, staged_output_paths
from pruneops.core.progress import progress
from pruneops.core.quality import (
    DenseShips,
    ModelSource,
    QualityBudget,
    QualityChange,
    accuracy_change,
    changes_beyond_corpus,
    perplexity_change,
)
from pruneops.data import zero_shot
from pruneops.data.zero_shot import zero_shot_correct
from pruneops.models.decoders import load_causal_lm
from pruneops.pipeline.stages import StageReport
from pruneops.pruning.decoder_vocabulary import vocabulary_cut_copy, vocabulary_evidence
from pruneops.runtimes.base import Runtime
from pruneops.task.causal_lm.common import (
    CHOICE_FILE,
    GENAI,
    MODEL_DIR,
    _timed,
    load_blocks,
    load_zero_shot,
    read_runtimes,
)

log = logging.getLogger(__name__)


# Training blocks a vocabulary cut runs the model on (expected counts, tail fit; about 25k tokens at 256).
VOCABULARY_BLOCKS = 96


@dataclass(frozen=True)
class PrecisionReport(StageReport):
    """The precision that ships and what each candidate measured."""

    precision: str
    vocabulary: int | None  # output rows kept (null: the full vocabulary)
    metric: str
    val_perplexity: float
    fp32_val_perplexity: float
    tpot_b1_ms: float
    fp32_tpot_b1_ms: float
    ttft_b1_ms: float
    fp32_ttft_b1_ms: float
    candidates: dict
    # What ships: the pruned model, or dense where no form of the pruned one is within the budget and faster.
    source: ModelSource = ModelSource.PRUNED
    dense_ships: DenseShips | None = None  # why dense ships (None: the pruned model does)
    budget: str = "none"  # prune.gate's quality budget, as text
    val_change: dict | None = None  # the shipped model's `QualityChange` against dense fp32 on validation
    general_change: dict | None = None  # the same on the general text's validation half (`general_text`)
    warnings: tuple[str, ...] = ()
    zero_shot_change: dict | None = None  # accuracy points on the zero-shot check's gating half (`zero_shot`)
    runtime: str = "genai"  # the runtime of what ships
    fastest_dense: str | None = None  # the fastest form of dense within the budgets (its candidate name)

    def summary(self) -> str:
        speedup = self.fp32_tpot_b1_ms / self.tpot_b1_ms, self.fp32_ttft_b1_ms / self.ttft_b1_ms
        form = self.precision if self.vocabulary is None else f"{self.precision}, vocabulary {self.vocabulary}"
        form = f"{form} in {self.runtime}"
        form = form if self.source is ModelSource.PRUNED else f"dense {form} ({self.dense_ships.why})"
        return (
            f"{form} (fastest in {self.metric} time within tolerance): {self.tpot_b1_ms:.2f} ms/token "
            f"({speedup[0]:.2f}x fp32), first token {self.ttft_b1_ms:.1f} ms ({speedup[1]:.2f}x fp32), "
            f"validation perplexity {self.val_perplexity:.2f} (fp32 {self.fp32_val_perplexity:.2f})"
        )


def _candidate_forms(model, config: QuantizeConfig, layout: Layout) -> dict[int | None, torch.nn.Module]:
    """The recovered model, and a copy with its output vocabulary cut to each size asked (by size)."""
    forms: dict[int | None, torch.nn.Module] = {None: model}
    if config.decoder_vocabulary:
        evidence = vocabulary_evidence(model, load_blocks(layout)["train"], VOCABULARY_BLOCKS)
        for keep in config.decoder_vocabulary:
            forms[keep], cut = vocabulary_cut_copy(model, evidence, keep, config.decoder_tail_groups)
            log.info("vocabulary %d: tail fitted to %.3f nats (rms)", keep, cut.fit_rms)
    return forms


def _candidate_name(precision: str, vocabulary: int | None) -> str:
    return precision if vocabulary is None else f"{precision} vocab{vocabulary}"


def _in_runtime(runtime: Runtime, name: str, first: Runtime) -> str:
    """Its name as in the first runtime (`int8 vocab16384`), prefixed in another (`llamacpp q4_k_m`)."""
    return name if runtime is first else f"{runtime.name} {name}"


Form = tuple[Runtime, str, int | None]  # a candidate: its runtime, precision and output vocabulary (None: full)


def _export_candidates(
    forms: dict[int | None, torch.nn.Module], runtimes: list[Runtime], precisions: dict[str, list[str]], work, ctx
) -> tuple[dict[str, Path], dict[str, Form]]:
    """Every form in every runtime's precisions; a cut vocabulary only where the runtime gathers its head (genai)."""
    tokenizer, threads = ctx
    folders: dict[str, Path] = {}
    kinds: dict[str, Form] = {}
    for runtime in runtimes:
        for vocabulary, form in forms.items():
            if vocabulary is not None and runtime is not GENAI:  # GGUF pads a cut head back: nothing to gain
                continue
            where = work / runtime.name / f"vocab{vocabulary or 'all'}"
            exported = runtime.export(form, where, precisions[runtime.name], tokenizer=tokenizer, threads=threads)
            for precision, folder in exported.items():
                name = _in_runtime(runtime, _candidate_name(precision, vocabulary), runtimes[0])
                folders[name], kinds[name] = folder, (runtime, precision, vocabulary)
    return folders, kinds


def quantize_decoder(
    config: QuantizeConfig,
    benchmark: BenchmarkConfig,
    metric: DecoderMetric,
    layout: Layout,
    budget: QualityBudget | None = None,
    general_budget: QualityBudget | None = None,
    zero_shot_budget: QualityBudget | None = None,
) -> PrecisionReport:
    """Exports the recovered decoder in fp32 and each of `decoder_precisions`; the fastest within tolerance ships.

    With `decoder_vocabulary`, every precision is also exported with the output vocabulary cut to
    each size (`pruneops.pruning.decoder_vocabulary`, ranked and fitted on training blocks). Each
    candidate is scored by its own exported logits on the validation blocks and timed interleaved
    at batch 1; a candidate whose validation perplexity exceeds fp32's by more than
    `perplexity_tolerance` (relative) is out, fp32 always in. Fastest is in `metric` (the prune
    target's: weight-only INT4 speeds decoding and can slow a long prefill).

    The quality budgets (`prune.gate.max_perplexity_increase`, and `max_general_perplexity_increase`
    on the general text's validation half where `validate.general_text` gives one; None: not gated):
    a candidate ships only if its perplexity against dense fp32 is within each at the far end of its
    95 % paired interval; where no form of the pruned model is, or where the fastest that is is no
    faster than dense's fastest form within the same budgets, dense in that form ships instead, and a
    warning gives the figures (`dense_ships` names which). Dense is exported and
    timed in every precision beside the candidates (once: where `finetune` passed dense's own files
    on, its forms are the candidates) (`artifacts/quantize/dense/<precision>`: the
    benchmark's rows of dense fp32, of dense in the runtime and precision that ships, and of the
    fastest dense form within the budgets). With several runtimes (`export.runtime: auto`), every
    runtime `train` found servable exports its precisions and all are timed together. Writes
    `artifacts/quantize/model` (the chosen runtime's folder) and every candidate's figures.
    """
    none = QualityBudget(None, "perplexity")
    budgets = Budgets(budget or none, general_budget or none, zero_shot_budget or QualityBudget(None, "points"))
    torch.set_num_threads(config.threads)
    model, tokenizer = load_causal_lm(layout.stage_dir("finetune") / MODEL_DIR)
    dense, _ = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    runtimes = read_runtimes(layout).runtimes
    blocks = load_blocks(layout)
    splits = {"val": blocks["val"], **({"general_val": blocks["general_val"]} if "general_val" in blocks else {})}
    out = layout.stage_dir("quantize")
    precisions = {r.name: _precisions(r, config) for r in runtimes}
    ctx = (tokenizer, benchmark.threads)
    recovered_is_dense = _same_model(layout)
    with staged_output_paths(out, layout.metrics("quantize")) as staged:
        work = staged.dir(out) / "candidates"
        folders, forms = _export_candidates(_candidate_forms(model, config, layout), runtimes, precisions, work, ctx)
        if recovered_is_dense:  # dense passed on unchanged: its forms are the candidates of the full vocabulary
            dense_folders = {n: f for n, f in folders.items() if forms[n][2] is None}
            dense_forms = {n: forms[n] for n in dense_folders}
        else:
            dense_folders, dense_forms = _export_candidates({None: dense}, runtimes, precisions, work / "dense", ctx)
        dense_names = {n: n if recovered_is_dense else f"dense {n}" for n in dense_folders}  # their timing keys
        timings = _timed({**{n: (forms[n][0], f) for n, f in folders.items()},
                          **{dense_names[n]: (dense_forms[n][0], f) for n, f in dense_folders.items()}},
                         model.config.vocab_size, 1, benchmark)  # fmt: skip
        cache = layout.state_dir() / "cache" / "scores"
        reference = _reference(runtimes[0], dense_folders["fp32"], splits, load_zero_shot(layout), cache)
        candidates = _judged(folders, forms, timings, splits, reference, budgets)
        dense_candidates = (
            {n: candidates[n] for n in dense_folders}
            if recovered_is_dense
            else _judged(dense_folders, dense_forms, {n: timings[k] for n, k in dense_names.items()}, splits,
                         reference, budgets)
        )  # fmt: skip
        source, warnings = ModelSource.PRUNED, []
        today = dense_candidates["fp32"]  # what the user serves now: no form ships much slower in either metric
        fastest_dense = _choose(dense_candidates, config, metric, today)
        chosen = _choose(candidates, config, metric, today)
        rival = None if recovered_is_dense else fastest_dense  # dense passed on: its forms are the candidates
        dense_ships = _dense_ships(candidates, chosen, dense_candidates, rival, config, metric, budgets)
        if dense_ships is not None:
            warnings.append(dense_ships[1])
            chosen, source = fastest_dense, ModelSource.DENSE
            folders, forms = dense_folders, dense_forms
        refused = _refused_elsewhere(
            dense_candidates if source is ModelSource.DENSE else candidates, config, metric, today
        )
        warnings.extend([refused] if refused else [])
        if source is ModelSource.DENSE:
            candidates = {**{f"pruned {n}": c for n, c in candidates.items()}, **dense_candidates}
        runtime, precision, vocabulary = forms[chosen]
        kept = _dense_kept(runtime, precision, runtimes[0], fastest_dense)
        for name in dict.fromkeys(kept.values()):  # before the move below: what ships may be one of these
            shutil.copytree(dense_folders[name], staged.path(out) / "dense" / _folder_name(name))
        folders[chosen].rename(staged.path(out) / MODEL_DIR)
        shutil.rmtree(work)
        dense_rows = {role: {"file": f"dense/{_folder_name(n)}", "runtime": dense_forms[n][0].name,
                             "precision": dense_forms[n][1], "candidate": n} for role, n in kept.items()}  # fmt: skip
        choice = {"runtime": runtime.name, "precision": precision, "vocabulary": vocabulary, "metric": metric,
                  "source": source, "dense_ships": dense_ships and dense_ships[0].value, "candidates": candidates,
                  "dense_candidates": dense_candidates,
                  "dense": dense_rows}  # fmt: skip
        dump_json(choice, staged.path(out) / CHOICE_FILE)
        report = PrecisionReport(
            precision=precision,
            vocabulary=vocabulary,
            metric=metric,
            val_perplexity=candidates[chosen]["val_perplexity"],
            fp32_val_perplexity=candidates["fp32"]["val_perplexity"],  # the fp32 of what ships (pruned or dense)
            tpot_b1_ms=candidates[chosen]["tpot_b1_ms"],
            fp32_tpot_b1_ms=candidates["fp32"]["tpot_b1_ms"],
            ttft_b1_ms=candidates[chosen]["ttft_b1_ms"],
            fp32_ttft_b1_ms=candidates["fp32"]["ttft_b1_ms"],
            candidates=candidates,
            source=source,
            dense_ships=dense_ships and dense_ships[0],
            budget=budgets.text(),
            val_change=candidates[chosen]["val_change"],
            general_change=candidates[chosen].get("general_change"),
            zero_shot_change=candidates[chosen].get("zero_shot_change"),
            warnings=tuple(warnings),
            runtime=runtime.name,
            fastest_dense=kept.get("fastest"),
        )
        dump_json(report.metrics(), staged.path(layout.metrics("quantize")))
    return report


def _same_model(layout: Layout) -> bool:
    """Whether `finetune` passed on the very files `train` wrote (dense, unpruned and unrecovered).

    Then the candidates are dense's own forms: exported, timed and scored once, not twice.
    """
    return folder_manifest(layout.stage_dir("finetune") / MODEL_DIR) == folder_manifest(
        layout.stage_dir("train") / MODEL_DIR
    )


def _precisions(runtime: Runtime, config: QuantizeConfig) -> list[str]:
    """fp32 and the precisions asked of `runtime`: `decoder_precisions` for genai, `gguf_precisions` for llama.cpp."""
    asked = config.decoder_precisions if runtime is GENAI else config.gguf_precisions
    return ["fp32", *(p for p in asked if p != "fp32")]


def _dense_kept(runtime: Runtime, precision: str, first: Runtime, fastest: str | None) -> dict[str, str]:
    """The dense forms the benchmark times beside what ships: fp32, the shipped precision, the fastest in budget."""
    kept = {"fp32": "fp32", "deployed": _in_runtime(runtime, precision, first)}
    return kept | {"fastest": fastest} if fastest is not None else kept


def _folder_name(candidate: str) -> str:
    """A candidate's name as a folder: `llamacpp q4_k_m` -> `llamacpp-q4_k_m`."""
    return candidate.replace(" ", "-")


@dataclass(frozen=True)
class Budgets:
    """The quality budgets a candidate is held to: on the corpus's validation blocks, general text, zero-shot."""

    val: QualityBudget
    general: QualityBudget
    zero_shot: QualityBudget = QualityBudget(None, "points")

    def text(self) -> str:
        """`+10 % perplexity` and, where gated, `; general text +15 % perplexity; zero-shot 3 pts`."""
        general = f"; general text {self.general.text()}" if self.general.limit is not None else ""
        zero_shot = f"; zero-shot {self.zero_shot.text()}" if self.zero_shot.limit is not None else ""
        return f"{self.val.text()}{general}{zero_shot}"


Scores = tuple[dict[str, np.ndarray], np.ndarray | None]  # per-block losses on each split; zero-shot answers


def _scored(
    runtime: Runtime, folder: Path, splits: dict[str, np.ndarray], check: dict | None, cache: Path | None
) -> Scores:
    """An exported model, opened once: its per-block losses on each split and (with a zero-shot check) its answers.

    Both come from its own logits in its runtime; the answers are on the check's gating half.
    Kept in `cache` (None: not kept) under a name made of the runtime (its libraries and scoring
    code), the export's files, the blocks and the check: the same export scored again (dense's
    forms in every re-prune, two experiments that share a recovery) is read back, not scored.
    """
    saved = None if cache is None else cache / f"{_score_key(runtime, folder, splits, check)}.npz"
    if saved is not None and saved.is_file():
        with np.load(saved) as kept:
            return {name: kept[f"loss {name}"] for name in splits}, kept["zero_shot"] if check is not None else None
    opened = runtime.open(folder, threads=2)
    losses = _losses(opened, splits)
    correct = None if check is None else zero_shot_correct(opened, check, "zero_shot_val")
    if saved is None:
        return losses, correct
    extra = {} if correct is None else {"zero_shot": correct}
    with replaced_whole(saved) as partial:
        np.savez(partial, **{f"loss {name}": value for name, value in losses.items()}, **extra)
    return losses, correct


def _score_key(runtime: Runtime, folder: Path, splits: dict[str, np.ndarray], check: dict | None) -> str:
    """A SHA-256 of what an export's scores depend on: its runtime and files, the blocks, the zero-shot check.

    The runtime's library versions and the code that scores (the runtime's package, the zero-shot
    scorer) are part of it: a changed scorer scores again.
    """
    package = Path(sys.modules[type(runtime).__module__].__file__).parent
    code = hashlib.sha256(b"".join(p.read_bytes() for p in [*sorted(package.rglob("*.py")), Path(zero_shot.__file__)]))
    scorer = [runtime.name, runtime.versions(), code.hexdigest()]
    digest = hashlib.sha256(json.dumps([scorer, folder_manifest(folder)], sort_keys=True).encode())
    for name, blocks in sorted(splits.items()):
        digest.update(name.encode())
        digest.update(np.ascontiguousarray(blocks, dtype=np.int64).tobytes())
    digest.update(json.dumps(check, sort_keys=True, default=str).encode())
    return digest.hexdigest()


def _losses(opened: object, splits: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """An opened export's per-block losses on each split."""
    return {name: opened.losses(blocks) for name, blocks in splits.items()}


@dataclass(frozen=True)
class DenseReference:
    """What every candidate is compared with: dense fp32's per-block losses and its zero-shot answers."""

    losses: dict[str, np.ndarray]
    check: dict | None = None  # validate's zero-shot check (None: not set)
    zero_shot_correct: np.ndarray | None = None  # dense's answer to each gating item, right or not
    folder: Path | None = None  # the export these were scored on: as a candidate, it is not scored again
    cache: Path | None = None  # where scores are kept (`_scored`; None: not kept)

    def scores(self, runtime: Runtime, folder: Path, splits: dict[str, np.ndarray]) -> Scores:
        """A candidate's losses and zero-shot answers: this reference's own where it is the same export."""
        if folder == self.folder:
            return self.losses, self.zero_shot_correct
        return _scored(runtime, folder, splits, self.check, self.cache)


def _reference(
    runtime: Runtime, folder: Path, splits: dict[str, np.ndarray], check: dict | None, cache: Path | None
) -> DenseReference:
    """Dense fp32's losses on each split and, with a zero-shot check, its answers on the gating half."""
    losses, correct = _scored(runtime, folder, splits, check, cache)
    return DenseReference(losses, check, correct, folder, cache)


def _judged(folders: dict, forms: dict, timings: dict, splits, dense: DenseReference, budgets: Budgets) -> dict:
    """Each candidate's perplexity (its own exported logits) and change against dense fp32 on each split, times.

    Within the budget means within it on validation and, where the corpus has general text, on its
    validation half too, and where `validate.zero_shot` is set, on the check's gating half.
    """
    dense_losses = dense.losses
    candidates = {}
    for name, folder in progress(folders.items(), "quantize: scoring candidates", len(folders), "models"):
        runtime, precision, vocabulary = forms[name]
        losses, correct = dense.scores(runtime, folder, splits)
        change = perplexity_change(losses["val"], dense_losses["val"])
        within = budgets.val.holds(change)
        candidates[name] = {
            "runtime": runtime.name,
            "precision": precision,
            "vocabulary": vocabulary,
            "val_perplexity": float(np.exp(losses["val"].mean())),
            "val_change": change.record(),
            "tpot_b1_ms": timings[name].tpot_ms,
            "ttft_b1_ms": timings[name].ttft_ms,
        }
        if "general_val" in losses:
            general = perplexity_change(losses["general_val"], dense_losses["general_val"])
            within = within and budgets.general.holds(general)
            candidates[name]["general_change"] = general.record()
        if correct is not None:  # each item answered right or not, against dense's answers item by item
            zero_shot = accuracy_change(correct, dense.zero_shot_correct)
            within = within and budgets.zero_shot.holds(zero_shot)
            candidates[name]["zero_shot_change"] = zero_shot.record()
        candidates[name]["within_budget"] = within
    return candidates


# Each metric a form is chosen on -> its timing key, and the other metric's key and words.
METRIC_KEYS: dict[DecoderMetric, str] = {"decode": "tpot_b1_ms", "prefill": "ttft_b1_ms"}
OTHER_METRIC: dict[DecoderMetric, tuple[str, str]] = {
    "decode": ("ttft_b1_ms", "to the first token"),
    "prefill": ("tpot_b1_ms", "per output token"),
}


def _choose(candidates: dict[str, dict], config: QuantizeConfig, metric: DecoderMetric, dense: dict) -> str | None:
    """The fastest in `metric` within the tolerance of fp32 and the budget, not slower than dense in the other metric.

    `dense` is dense fp32's record (what the user serves today). None where the quality leaves none.
    """
    kept = [
        n for n in _within_quality(candidates, config) if n not in _slower_elsewhere(candidates, config, metric, dense)
    ]
    return min(kept, key=lambda n: candidates[n][METRIC_KEYS[metric]]) if kept else None


def _within_quality(candidates: dict[str, dict], config: QuantizeConfig) -> list[str]:
    """The forms within `perplexity_tolerance` of fp32 and within the budget."""
    ceiling = candidates["fp32"]["val_perplexity"] * (1 + config.perplexity_tolerance)
    return [n for n, c in candidates.items() if c["val_perplexity"] <= ceiling and c["within_budget"]]


def _slower_elsewhere(candidates: dict[str, dict], config: QuantizeConfig, metric: DecoderMetric, dense: dict) -> dict:
    """Each form slower than dense fp32 in the other metric beyond `other_metric_tolerance`: its ratio to dense's."""
    if config.other_metric_tolerance is None:
        return {}
    key = OTHER_METRIC[metric][0]
    ratios = {n: c[key] / dense[key] for n, c in candidates.items()}
    return {n: r for n, r in ratios.items() if r > 1 + config.other_metric_tolerance}


def _refused_elsewhere(
    candidates: dict[str, dict], config: QuantizeConfig, metric: DecoderMetric, dense: dict
) -> str | None:
    """The warning where a form faster in `metric` than the one chosen, within quality, was refused for the other."""
    chosen = _choose(candidates, config, metric, dense)
    slower = _slower_elsewhere(candidates, config, metric, dense)
    if chosen is None or not slower:
        return None
    key, within = METRIC_KEYS[metric], _within_quality(candidates, config)
    faster = {n: r for n, r in slower.items() if n in within and candidates[n][key] < candidates[chosen][key]}
    if not faster:
        return None
    words = OTHER_METRIC[metric][1]
    listed = ", ".join(f"{n} ({candidates[n][key]:.2f} ms, {r:.2f}x dense's time {words})" for n, r in faster.items())
    return (
        f"quantize.other_metric_tolerance: {listed} would be faster in {metric} than {chosen} "
        f"({candidates[chosen][key]:.2f} ms), each more than {100 * config.other_metric_tolerance:.0f} % slower "
        f"than dense fp32 {words}, so {chosen} ships (null ships the fastest in {metric} whatever its time {words})"
    )


def _dense_ships(
    candidates: dict[str, dict],
    chosen: str | None,
    dense_candidates: dict[str, dict],
    rival: str | None,
    config: QuantizeConfig,
    metric: DecoderMetric,
    budgets: Budgets,
) -> tuple[DenseShips, str] | None:
    """Why dense ships instead of `chosen` (the pruned model's pick), and the warning that says so; None: it ships.

    Dense ships where no form of the pruned model is within the budgets, where those within are all too
    slow in the other metric, and where the fastest of them is no faster in `metric` than `rival`,
    dense's fastest form within the same budgets (what the user gets without pruning: shipping the
    pruned model there would be a regression; None where the candidates are dense's own forms).
    """
    if chosen is None:
        elsewhere = _slower_elsewhere(candidates, config, metric, dense_candidates["fp32"])
        within = [n for n in _within_quality(candidates, config) if n in elsewhere]
        if within:
            return DenseShips.SLOWER_ELSEWHERE, _backed_off_elsewhere(within, elsewhere, config, metric)
        return DenseShips.OUTSIDE_BUDGET, _backed_off(candidates, budgets)
    key = METRIC_KEYS[metric]
    if rival is None or candidates[chosen][key] < dense_candidates[rival][key]:
        return None
    words = "a token" if metric == "decode" else "to the first token"
    return DenseShips.NOT_FASTER, (
        f"prune.gate: the fastest form of the pruned model within the budget ({budgets.text()}), {chosen} at "
        f"{candidates[chosen][key]:.2f} ms {words}, is no faster than dense {rival} at "
        f"{dense_candidates[rival][key]:.2f} ms within the same budget; the dense model ships instead "
        "(a quantized form of the pruned model within the budget, from more finetune.max_tokens or a milder "
        "prune.target, would let one through)"
    )


def _backed_off_elsewhere(within: list[str], ratios: dict, config: QuantizeConfig, metric: DecoderMetric) -> str:
    """The warning of a back-off to dense where forms within the budgets were all refused for the other metric."""
    words = OTHER_METRIC[metric][1]
    listed = ", ".join(f"{n} {ratios[n]:.2f}x" for n in within)
    return (
        f"quantize.other_metric_tolerance: every form of the pruned model within the budgets is more than "
        f"{100 * config.other_metric_tolerance:.0f} % slower than dense fp32 {words} ({listed} dense's time); "
        "the dense model ships instead "
        f"(null ships the fastest in {metric} whatever its time {words})"
    )


def _backed_off(candidates: dict[str, dict], budgets: Budgets) -> str:
    """The warning of a back-off to dense: what each form of the pruned model measured against the budgets."""

    def figures(c: dict) -> str:
        beyond = changes_beyond_corpus(c)
        return QualityChange(**c["val_change"]).text() + (f" ({', '.join(beyond)})" if beyond else "")

    listed = ", ".join(f"{n} {figures(c)}" for n, c in candidates.items())
    return (
        "prune.gate: no form of the pruned model is within the budget against dense on validation "
        f"({budgets.text()}), judged at the far end of its 95 % interval ({listed}); the dense model ships instead "
        "(a milder prune.target, more finetune.max_tokens, general text in the recovery, or a larger budget "
        f"would let one through){_zero_shot_resolution(candidates, budgets)}"
    )


def _zero_shot_resolution(candidates: dict[str, dict], budgets: Budgets) -> str:
    """`; the zero-shot check's N gating items ...`: how wide its intervals were, where it gates (else empty).

    The far end is what the budget holds: an interval as wide as the budget refuses forms that change
    few answers, and only more items (`validate.zero_shot_items`) narrow it.
    """
    changes = [QualityChange(**c["zero_shot_change"]) for c in candidates.values() if c.get("zero_shot_change")]
    if budgets.zero_shot.limit is None or not changes:
        return ""
    widest = max(change.high - change.low for change in changes) / 2
    return (
        f"; the zero-shot check's {changes[0].samples} gating items gave intervals up to ±{widest:.1f} points "
        f"against its {budgets.zero_shot.limit:g}-point budget (validate.zero_shot_items: more items narrow them)"
    )


def quantize_stage(
    config: QuantizeConfig, benchmark: BenchmarkConfig, prune: PruneConfig, layout: Layout
) -> PrecisionReport:
    """The stage: `quantize_decoder` in the prune target's metric (time per output token, or to the first token)."""
    gate = prune.gate
    return quantize_decoder(
        config,
        benchmark,
        prune.target.decoder_metric,
        layout,
        gate.budget("causal_lm"),
        gate.general_budget(),
        gate.zero_shot_budget(),
    )
