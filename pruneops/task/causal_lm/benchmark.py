"""`benchmark` for a causal LM: time to first token and per output token, and test perplexity, against dense."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pruneops.config import BenchmarkConfig
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.core.quality import ModelSource, perplexity_change
from pruneops.models.language import paired_ratio_interval, perplexity_from_losses
from pruneops.reports.decoder_plots import plot_decoder_frontier
from pruneops.reports.summary import BenchmarkSummary, ordered, speedup_against
from pruneops.task.causal_lm.common import DECODER_RUNTIMES, load_blocks, load_zero_shot
from pruneops.task.causal_lm.rows import quality_figures, score_rows, time_rows
from pruneops.timing.machine import machine_info


@dataclass(frozen=True)
class DecoderBenchmarkReport(BenchmarkSummary):
    """The headline every benchmark gives (`BenchmarkSummary`), and a causal LM's own times and perplexities."""

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
    general_change: dict | None = None  # `QualityChange` of the general text's perplexity (validate.general_text)
    zero_shot_change: dict | None = None  # `QualityChange` of the zero-shot check (validate.zero_shot), in points
    runtime: str = "genai"  # what ships is served by

    def summary(self) -> str:
        low, high = self.test_perplexity_ratio_ci
        return (
            f"{self.shipped}: {self.tpot_b1_ms:.2f} ms/token, {self.speedup_b1:.2f}x dense fp32 "
            f"({self.speedup_b1_same_precision:.2f}x dense {self.precision}), first token {self.ttft_b1_ms:.1f} ms "
            f"({self.ttft_speedup_b1:.2f}x dense fp32); test perplexity "
            f"{100 * (self.test_perplexity_ratio - 1):+.1f} % [{100 * (low - 1):+.1f}, {100 * (high - 1):+.1f}]"
        )


def benchmark_decoder(config: BenchmarkConfig, layout: Layout) -> DecoderBenchmarkReport:
    """Times every exported model interleaved (TTFT, time per output token, each batch) and scores them.

    The rows are the export's manifest (dense fp32, dense in the shipped precision, pruned fp32,
    what ships). Test perplexity by each model's own exported logits, as a ratio to dense fp32 with
    a paired bootstrap interval over blocks. Writes `artifacts/benchmark/results.json` and the
    frontier plot.
    """
    export = layout.stage_dir("export")
    manifest = read_json(export / "manifest.json")
    rows = dict(ordered(manifest["models"]))
    models = {name: (DECODER_RUNTIMES[m["runtime"]], export / m["file"]) for name, m in rows.items()}
    shipped = manifest["models"]["pruned_deployed"]
    blocks = load_blocks(layout)
    timed = time_rows(models, config)  # dense fp32 first (`ordered`)
    figures = {n: {"precision": m["precision"], "runtime": m["runtime"], **timed[n]} for n, m in rows.items()}
    scored = {split: blocks[split] for split in ("test", "general") if split in blocks}  # general: beyond the corpus
    scores = score_rows(models, scored, load_zero_shot(layout), "benchmark")
    for name, quality in quality_figures(scores, "dense_fp32").items():
        figures[name].update(quality)  # general text's and the zero-shot check's changes against dense, paired
    losses = {name: s.losses["test"] for name, s in scores.items()}
    dense = perplexity_from_losses(losses["dense_fp32"], 0)
    for name, (runtime, folder) in models.items():
        ppl = perplexity_from_losses(losses[name], 0)
        ratio, low, high = paired_ratio_interval(ppl, dense)
        f = figures[name]
        f.update(test_perplexity=ppl.value, test_ratio=ratio, test_ratio_ci=[low, high], quality=ppl.value)
        f.update(latency_b1_ms=f["tpot_b1_ms"], speedup_b1=figures["dense_fp32"]["tpot_b1_ms"] / f["tpot_b1_ms"])
        f["size_bytes"] = sum(p.stat().st_size for p in runtime.files(folder))
    served = figures["pruned_deployed"]
    same = figures.get("dense_deployed", figures["dense_fp32"])
    out, plots = layout.stage_dir("benchmark"), layout.plots("benchmark")
    frontier = [
        {"name": n, "latency_b1_ms": f["tpot_b1_ms"], "test_perplexity": f["test_perplexity"]}
        for n, f in figures.items()
    ]
    machine = machine_info(config.threads, *dict.fromkeys(m["runtime"] for m in rows.values()))
    with staged_output_paths(out, layout.metrics("benchmark"), plots) as staged:
        results = {"rows": figures, "machine": machine, "batch_sizes": config.batch_sizes}
        dump_json(results, staged.dir(out) / "results.json")
        dump_json(frontier, staged.dir(plots) / "frontier.json")
        plot_decoder_frontier(frontier, staged.path(plots) / "frontier.png")
        vocabulary = f", vocabulary {shipped['vocabulary']}" if shipped.get("vocabulary") else ""
        source = ModelSource.read(shipped.get("source"))
        report = DecoderBenchmarkReport(
            task="causal_lm",
            shipped=f"{source} {shipped['precision']}{vocabulary}",
            source=source,
            dense_ships=shipped.get("dense_ships"),
            precision=shipped["precision"],
            latency_metric="time per output token",
            latency_b1_ms=served["tpot_b1_ms"],
            dense_latency_b1_ms=figures["dense_fp32"]["tpot_b1_ms"],
            speedup_b1=served["speedup_b1"],
            speedup_b1_same_precision=same["tpot_b1_ms"] / served["tpot_b1_ms"],
            quality_metric="test perplexity",
            quality=served["test_perplexity"],
            dense_quality=dense.value,
            quality_change=perplexity_change(losses["pruned_deployed"], losses["dense_fp32"]).record(),
            size_reduction=figures["dense_fp32"]["size_bytes"] / served["size_bytes"],
            models=figures,
            machine=machine,
            tpot_b1_ms=served["tpot_b1_ms"],
            dense_tpot_b1_ms=figures["dense_fp32"]["tpot_b1_ms"],
            ttft_speedup_b1=figures["dense_fp32"]["ttft_b1_ms"] / served["ttft_b1_ms"],
            ttft_b1_ms=served["ttft_b1_ms"],
            dense_ttft_b1_ms=figures["dense_fp32"]["ttft_b1_ms"],
            test_perplexity=served["test_perplexity"],
            dense_test_perplexity=dense.value,
            test_perplexity_ratio=served["test_ratio"],
            test_perplexity_ratio_ci=served["test_ratio_ci"],
            results=out / "results.json",
            general_change=served.get("general_change"),
            zero_shot_change=served.get("zero_shot_change"),
            runtime=shipped["runtime"],
            fastest_dense=manifest.get("fastest_dense"),
            speedup_b1_vs_fastest_dense=speedup_against(figures, manifest.get("fastest_dense")),
        )
        dump_json(report.metrics(), staged.path(layout.metrics("benchmark")))
    return report
