"""`quantize` for a causal LM: every precision (and output vocabulary) exported, the fastest within tolerance ships."""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass

import numpy as np
import torch

from pruneops.config import BenchmarkConfig, PruneConfig, QuantizeConfig
from pruneops.config.prune import DecoderMetric
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoders import load_causal_lm
from pruneops.pipeline.stages import StageReport
from pruneops.pruning.decoder_vocabulary import vocabulary_cut_copy, vocabulary_evidence
from pruneops.task.causal_lm.common import CHOICE_FILE, GENAI, MODEL_DIR, _timed, load_blocks

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

    def summary(self) -> str:
        speedup = self.fp32_tpot_b1_ms / self.tpot_b1_ms, self.fp32_ttft_b1_ms / self.ttft_b1_ms
        form = self.precision if self.vocabulary is None else f"{self.precision}, vocabulary {self.vocabulary}"
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
            folder = work / f"vocab{vocabulary or 'all'}"
            exported = GENAI.export(form, folder, precisions, tokenizer=tokenizer, threads=benchmark.threads)
            for precision, folder in exported.items():
                folders[_candidate_name(precision, vocabulary)] = folder
                forms[_candidate_name(precision, vocabulary)] = (precision, vocabulary)
        timings = _timed(folders, model.config.vocab_size, 1, benchmark)
        candidates = {}
        for name, folder in folders.items():
            ppl = float(np.exp(GENAI.open(folder, threads=2).losses(val).mean()))
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


def quantize_stage(
    config: QuantizeConfig, benchmark: BenchmarkConfig, prune: PruneConfig, layout: Layout
) -> PrecisionReport:
    """The stage: `quantize_decoder` in the prune target's metric (time per output token, or to the first token)."""
    return quantize_decoder(config, benchmark, prune.target.decoder_metric, layout)
