"""The decoder path of `quantize`, `export` and `benchmark`: the precision that ships, parity, timing."""

from __future__ import annotations

import logging
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import BenchmarkConfig, ExportConfig, QuantizeConfig
from pruneops.config.prune import DecoderMetric
from pruneops.core.errors import ParityError
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.models.decoders import load_causal_lm
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses
from pruneops.modelstore.decoder import SERVED_FILE
from pruneops.pipeline.stages import StageReport
from pruneops.pruning.decoder_vocabulary import vocabulary_cut_copy, vocabulary_evidence
from pruneops.reports.decoder_plots import plot_decoder_frontier
from pruneops.runtimes.genai.generation import exported_block_losses, greedy_tokens, time_generation
from pruneops.task.causal_lm.common import MODEL_DIR, export_genai, load_blocks
from pruneops.timing.machine import machine_info

log = logging.getLogger(__name__)

CHOICE_FILE = "precision.json"  # quantize's choice and every candidate's figures
# Training blocks a vocabulary cut runs the model on (expected counts, tail fit; about 25k tokens at 256).
VOCABULARY_BLOCKS = 96
PARITY_PROMPT_TOKENS = 32  # the greedy parity check's prompt: the start of the first test block


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

    def summary(self) -> str:
        speedup = self.fp32_tpot_b1_ms / self.tpot_b1_ms, self.fp32_ttft_b1_ms / self.ttft_b1_ms
        form = self.precision if self.vocabulary is None else f"{self.precision}, vocabulary {self.vocabulary}"
        return (
            f"{form} (fastest in {self.metric} time within tolerance): {self.tpot_b1_ms:.2f} ms/token "
            f"({speedup[0]:.2f}x fp32), first token {self.ttft_b1_ms:.1f} ms ({speedup[1]:.2f}x fp32), "
            f"validation perplexity {self.val_perplexity:.2f} (fp32 {self.fp32_val_perplexity:.2f})"
        )


def _timed(folders: dict[str, Path], vocab: int, batch: int, benchmark: BenchmarkConfig, seed: int = 0) -> dict:
    prompt = np.random.default_rng(seed).integers(0, vocab, (batch, benchmark.prompt_length))
    return time_generation(folders, prompt, benchmark.new_tokens, benchmark.rounds)


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


def quantize_decoder(
    config: QuantizeConfig, benchmark: BenchmarkConfig, metric: DecoderMetric, layout: Layout
) -> PrecisionReport:
    """Exports the recovered decoder in fp32 and each of `decoder_precisions`; the fastest within tolerance ships.

    With `decoder_vocabulary`, every precision is also exported with the output vocabulary cut to
    each size (`pruneops.pruning.decoder_vocabulary`, ranked and fitted on training blocks). Each
    candidate is scored by its own exported logits on the validation blocks and timed interleaved
    at batch 1; a candidate whose validation perplexity exceeds fp32's by more than
    `perplexity_tolerance` (relative) is out, fp32 always in. Fastest is in `metric` (the prune
    target's: weight-only INT4 speeds decoding and can slow a long prefill). Writes
    `artifacts/quantize/model` (an onnxruntime-genai folder) and every candidate's figures.
    """
    torch.set_num_threads(config.threads)
    model, tokenizer = load_causal_lm(layout.stage_dir("finetune") / MODEL_DIR)
    val = load_blocks(layout)["val"]
    out = layout.stage_dir("quantize")
    with staged_output_paths(out, layout.metrics("quantize")) as staged:
        work = staged.dir(out) / "candidates"
        folders, forms = {}, {}
        for vocabulary, form in _candidate_forms(model, config, layout).items():
            precisions = ["fp32", *config.decoder_precisions]
            exported = export_genai(
                form, tokenizer, work / f"vocab{vocabulary or 'all'}", precisions, benchmark.threads
            )
            for precision, folder in exported.items():
                folders[_candidate_name(precision, vocabulary)] = folder
                forms[_candidate_name(precision, vocabulary)] = (precision, vocabulary)
        timings = _timed(folders, model.config.vocab_size, 1, benchmark)
        candidates = {}
        for name, folder in folders.items():
            ppl = float(np.exp(exported_block_losses(folder, val, threads=2).mean()))
            timing = timings[name]
            precision, vocabulary = forms[name]
            candidates[name] = {
                "precision": precision,
                "vocabulary": vocabulary,
                "val_perplexity": ppl,
                "tpot_b1_ms": timing.tpot_ms,
                "ttft_b1_ms": timing.ttft_ms,
            }
        ceiling = candidates["fp32"]["val_perplexity"] * (1 + config.perplexity_tolerance)
        within = [p for p, c in candidates.items() if c["val_perplexity"] <= ceiling]
        chosen = min(within, key=lambda p: timings[p].milliseconds(metric))
        folders[chosen].rename(staged.path(out) / MODEL_DIR)
        shutil.rmtree(work)
        precision, vocabulary = forms[chosen]
        choice = {"precision": precision, "vocabulary": vocabulary, "metric": metric, "candidates": candidates}
        dump_json(choice, staged.path(out) / CHOICE_FILE)
        report = PrecisionReport(
            precision=precision,
            vocabulary=vocabulary,
            metric=metric,
            val_perplexity=candidates[chosen]["val_perplexity"],
            fp32_val_perplexity=candidates["fp32"]["val_perplexity"],
            tpot_b1_ms=candidates[chosen]["tpot_b1_ms"],
            fp32_tpot_b1_ms=candidates["fp32"]["tpot_b1_ms"],
            ttft_b1_ms=candidates[chosen]["ttft_b1_ms"],
            fp32_ttft_b1_ms=candidates["fp32"]["ttft_b1_ms"],
            candidates=candidates,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("quantize")))
    return report


@dataclass(frozen=True)
class DecoderExportReport(StageReport):
    """The served folder, the dense references and the greedy parity of the fp32 export."""

    precision: str
    greedy_tokens_checked: int
    greedy_tokens_equal: int
    tensorrt: str
    model_dir: Path

    def summary(self) -> str:
        return (
            f"{self.precision} onnxruntime-genai folder; fp32 greedy parity {self.greedy_tokens_equal}/"
            f"{self.greedy_tokens_checked} tokens -> {self.model_dir}"
        )


def _greedy_parity(model, folder: Path, prompt: np.ndarray, tokens: int) -> int:
    """Generated tokens the exported model shares with torch's greedy output before the first difference."""
    ids = torch.as_tensor(prompt)
    expected = model.generate(
        ids, attention_mask=torch.ones_like(ids), max_new_tokens=tokens, min_new_tokens=tokens, do_sample=False
    )[:, ids.shape[1] :].numpy()
    exported = greedy_tokens(folder, prompt, tokens)
    differ = np.flatnonzero(exported[0] != expected[0])
    return int(differ[0]) if len(differ) else tokens


def export_decoder(config: ExportConfig, layout: Layout) -> DecoderExportReport:
    """Writes the served decoder folder, the dense references the benchmark times, and checks parity.

    `artifacts/export/model` is the precision `quantize` chose; `artifacts/export/dense/<precision>`
    the adopted model in fp32 and in that precision. The recovered model exported in fp32 must
    generate `greedy_tokens` greedy tokens exactly as torch does.

    Raises:
        ParityError: The exported fp32 model's greedy output leaves torch's.
    """
    model, tokenizer = load_causal_lm(layout.stage_dir("finetune") / MODEL_DIR)
    dense, _ = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    choice = read_json(layout.stage_dir("quantize") / CHOICE_FILE)
    precision = choice["precision"]
    prompt = load_blocks(layout)["test"][:1, :PARITY_PROMPT_TOKENS].astype(np.int32)
    with tempfile.TemporaryDirectory(prefix="pruneops-decode-parity-") as work:
        fp32 = export_genai(model, tokenizer, Path(work), ["fp32"], 1)["fp32"]
        equal = _greedy_parity(model, fp32, prompt, config.greedy_tokens)
    if equal < config.greedy_tokens:
        raise ParityError(
            f"export: the fp32 export's greedy output leaves torch's after {equal} of {config.greedy_tokens} tokens"
        )
    out = layout.stage_dir("export")
    with staged_output_paths(out, layout.metrics("export")) as staged:
        shutil.copytree(layout.stage_dir("quantize") / MODEL_DIR, staged.dir(out) / MODEL_DIR)
        export_genai(dense, tokenizer, staged.path(out) / "dense", sorted({"fp32", precision}), 1)
        shutil.copy(layout.stage_dir("validate") / "prompt_reference.json", staged.path(out) / "prompt_reference.json")
        dump_json({"precision": precision, "vocabulary": choice["vocabulary"]}, staged.path(out) / SERVED_FILE)
        report = DecoderExportReport(
            precision=precision,
            greedy_tokens_checked=config.greedy_tokens,
            greedy_tokens_equal=equal,
            tensorrt="not built: decoder LLMs are served by onnxruntime-genai",
            model_dir=out / MODEL_DIR,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("export")))
    return report


@dataclass(frozen=True)
class DecoderBenchmarkReport(StageReport):
    """Decode time and test perplexity of the served model against dense."""

    precision: str
    speedup_b1: float
    speedup_b1_same_precision: float
    tpot_b1_ms: float
    dense_tpot_b1_ms: float
    ttft_speedup_b1: float
    ttft_b1_ms: float
    dense_ttft_b1_ms: float
    test_perplexity: float
    dense_test_perplexity: float
    test_perplexity_ratio: float
    test_perplexity_ratio_ci: list
    results: Path

    def summary(self) -> str:
        low, high = self.test_perplexity_ratio_ci
        return (
            f"served ({self.precision}): {self.tpot_b1_ms:.2f} ms/token, {self.speedup_b1:.2f}x dense fp32 "
            f"({self.speedup_b1_same_precision:.2f}x dense {self.precision}), first token {self.ttft_b1_ms:.1f} ms "
            f"({self.ttft_speedup_b1:.2f}x dense fp32); test perplexity "
            f"{100 * (self.test_perplexity_ratio - 1):+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"
        )


def _rows(layout: Layout, precision: str) -> dict[str, Path]:
    export = layout.stage_dir("export")
    rows = {"dense fp32": export / "dense" / "fp32"}
    if precision != "fp32":
        rows[f"dense {precision}"] = export / "dense" / precision
    rows[f"served {precision}"] = export / MODEL_DIR
    return rows


def benchmark_decoder(config: BenchmarkConfig, layout: Layout) -> DecoderBenchmarkReport:
    """Times dense and the served decoder interleaved (TTFT, time per output token, each batch) and scores them.

    Test perplexity by each model's own exported logits, the served one's as a ratio to dense
    fp32 with a paired bootstrap interval over blocks. Writes `artifacts/benchmark/results.json`
    and the frontier plot.
    """
    precision = read_json(layout.stage_dir("export") / SERVED_FILE)["precision"]
    folders = _rows(layout, precision)
    test = load_blocks(layout)["test"]
    vocab = int(read_json(folders["dense fp32"] / "genai_config.json")["model"]["vocab_size"])
    figures: dict[str, dict] = {name: {} for name in folders}
    for batch in sorted({1, *config.batch_sizes}):
        for name, timing in _timed(folders, vocab, batch, config).items():
            figures[name][f"ttft_b{batch}_ms"] = timing.ttft_ms
            figures[name][f"tpot_b{batch}_ms"] = timing.tpot_ms
    losses = {name: exported_block_losses(folder, test, threads=2) for name, folder in folders.items()}
    dense = perplexity_from_losses(losses["dense fp32"], 0)
    for name in folders:
        ppl = perplexity_from_losses(losses[name], 0)
        ratio, low, high = paired_ratio_interval(ppl, dense)
        figures[name].update(test_perplexity=ppl.value, test_ratio=ratio, test_ratio_ci=[low, high])
    served, same = figures[f"served {precision}"], figures[f"dense {precision}"]
    out, plots = layout.stage_dir("benchmark"), layout.plots("benchmark")
    frontier = [
        {"name": n, "latency_b1_ms": f["tpot_b1_ms"], "test_perplexity": f["test_perplexity"]}
        for n, f in figures.items()
    ]
    with staged_output_paths(out, layout.metrics("benchmark"), plots) as staged:
        results = {"rows": figures, "machine": machine_info(config.threads), "batch_sizes": config.batch_sizes}
        dump_json(results, staged.dir(out) / "results.json")
        dump_json(frontier, staged.dir(plots) / "frontier.json")
        plot_decoder_frontier(frontier, staged.path(plots) / "frontier.png")
        report = DecoderBenchmarkReport(
            precision=precision,
            speedup_b1=figures["dense fp32"]["tpot_b1_ms"] / served["tpot_b1_ms"],
            speedup_b1_same_precision=same["tpot_b1_ms"] / served["tpot_b1_ms"],
            tpot_b1_ms=served["tpot_b1_ms"],
            dense_tpot_b1_ms=figures["dense fp32"]["tpot_b1_ms"],
            ttft_speedup_b1=figures["dense fp32"]["ttft_b1_ms"] / served["ttft_b1_ms"],
            ttft_b1_ms=served["ttft_b1_ms"],
            dense_ttft_b1_ms=figures["dense fp32"]["ttft_b1_ms"],
            test_perplexity=served["test_perplexity"],
            dense_test_perplexity=dense.value,
            test_perplexity_ratio=served["test_ratio"],
            test_perplexity_ratio_ci=served["test_ratio_ci"],
            results=out / "results.json",
        )
        dump_json(report.metrics(), staged.path(layout.metrics("benchmark")))
    return report
