"""`benchmark` for a causal LM: time to first token and per output token, and test perplexity, against dense."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pruneops.config import BenchmarkConfig
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses
from pruneops.modelstore.decoder import SERVED_FILE
from pruneops.pipeline.stages import StageReport
from pruneops.reports.decoder_plots import plot_decoder_frontier
from pruneops.task.causal_lm.common import GENAI, MODEL_DIR, _timed, load_blocks
from pruneops.timing.machine import machine_info


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
    vocab = GENAI.open(folders["dense fp32"]).vocab_size
    figures: dict[str, dict] = {name: {} for name in folders}
    for batch in sorted({1, *config.batch_sizes}):
        for name, timing in _timed(folders, vocab, batch, config).items():
            figures[name][f"ttft_b{batch}_ms"] = timing.ttft_ms
            figures[name][f"tpot_b{batch}_ms"] = timing.tpot_ms
    losses = {name: GENAI.open(folder, threads=2).losses(test) for name, folder in folders.items()}
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
        results = {
            "rows": figures,
            "machine": machine_info(config.threads, GENAI.name),
            "batch_sizes": config.batch_sizes,
        }
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
