"""`benchmark` stage: latency, throughput, size and accuracy of every exported model."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from pruneops.config import BenchmarkConfig
from pruneops.core.errors import DataError
from pruneops.core.integrity import verify_file
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.core.quality import ModelSource, accuracy_change
from pruneops.data import load_prepared
from pruneops.reports.plots import plot_frontier
from pruneops.reports.summary import (
    BenchmarkSummary,
    Column,
    latency_columns,
    latency_summary,
    render_table,
    speedup_against,
)
from pruneops.runtimes.onnxruntime.files import file_size, make_session, ort_logits
from pruneops.runtimes.onnxruntime.timing import measure_latencies
from pruneops.timing.machine import cuda_device, gpu_not_timed, machine_info


@dataclass(frozen=True)
class BenchmarkReport(BenchmarkSummary):
    """The headline every benchmark gives (`BenchmarkSummary`), and a classifier's own figures."""

    speedup_b1_deployed_vs_dense: float
    speedup_b1_pruned_fp32_vs_dense: float
    mac_reduction: float
    accuracy_delta_points_deployed: float
    slower_than_dense: list[str]
    machine: dict
    warnings: list[str]
    table: Path

    def summary(self) -> str:
        return (
            f"batch-1 speed-up vs dense fp32: deployed {self.speedup_b1_deployed_vs_dense:.2f}x, "
            f"pruned fp32 {self.speedup_b1_pruned_fp32_vs_dense:.2f}x; {self.mac_reduction:.2f}x fewer MACs "
            f"-> {self.table}"
        )


def markdown_table(models: dict, batch_sizes: list[int]) -> str:
    """The pipeline's benchmark as a markdown table."""
    columns: list[Column] = [
        ("model", lambda r: f"{r['name']} ({r['precision']})"),
        ("test acc (%)", lambda r: f"{100 * r['test_accuracy']:.2f}"),
        ("params", lambda r: f"{r['params']:,}"),
        ("MACs", lambda r: f"{r['macs']:,}"),
        ("size (KiB)", lambda r: f"{r['size_bytes'] / 1024:.1f}"),
        *latency_columns(batch_sizes),
        (
            "b1 speed-up",
            lambda r: f"{r['speedup_b1']:.2f}x" + (" ⚠ slower than dense" if r.get("slower_than_dense") else ""),
        ),
    ]
    return render_table([{"name": n, **m} for n, m in models.items()], columns)


def benchmark_model(config: BenchmarkConfig, layout: Layout | None = None) -> BenchmarkReport:
    """Benchmarks dense fp32, pruned fp32 and the deployed model in one process with ONNX Runtime CPU.

    Each model gets the same thread count, warm-up and repeats; rounds are interleaved.

    Returns:
        The report; `metrics/benchmark.json`, `artifacts/benchmark/benchmark.md` and
        `plots/benchmark/frontier.png`.
    """
    layout = layout or Layout()
    _, _, _, test = load_prepared(layout.stage_dir("validate"))
    export_dir = layout.stage_dir("export")
    if not (export_dir / "manifest.json").is_file():
        raise DataError(f"{export_dir / 'manifest.json'}: not found; run `pruneops export` first")
    manifest = read_json(export_dir / "manifest.json")
    for m in manifest["models"].values():  # a file changed since export is refused, never measured
        verify_file(export_dir / m["file"], m.get("sha256"))
    sessions = {name: make_session(export_dir / m["file"], config.threads) for name, m in manifest["models"].items()}
    samples = measure_latencies(sessions, test.x, config)
    models: dict[str, dict] = {}
    correct = {}
    for name, m in manifest["models"].items():
        latency = {str(b): latency_summary(t, b) for b, t in samples[name].items()}
        correct[name] = ort_logits(sessions[name], test.x).argmax(1) == test.y
        models[name] = {
            "precision": m["precision"],
            "params": m["params"],
            "macs": m["macs"],
            "size_bytes": file_size(export_dir / m["file"]),
            "test_accuracy": float(correct[name].mean()),
            "quality": float(correct[name].mean()),
            "test_samples": len(test),
            "latency": latency,
            "latency_b1_ms": latency["1"]["p50_ms"],
        }
    dense = models["dense_fp32"]["latency"]
    for m in models.values():
        m["speedup_b1"] = dense["1"]["p50_ms"] / m["latency"]["1"]["p50_ms"]
        # Slower than dense fp32 at any batch size is a regression the report must show.
        m["slower_than_dense"] = any(m["latency"][b]["p50_ms"] > dense[b]["p50_ms"] for b in dense)
    deployed, shipped = models["pruned_deployed"], manifest["models"]["pruned_deployed"]
    same = models.get("dense_deployed", models["dense_fp32"])
    trt = manifest.get("tensorrt", {})
    gpu = cuda_device()
    machine = {
        **machine_info(config.threads),
        "tensorrt": "; ".join(f"{k}: {v['status']} — {v.get('reason', '')}" for k, v in trt.items()) or "not requested",
        "cuda_device": gpu,
    }
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("benchmark"),
        layout.metrics("benchmark"),
        layout.plots("benchmark"),
    )
    source = ModelSource.read(shipped.get("source"))
    report = BenchmarkReport(
        task="classification",
        shipped=f"{source} {shipped.get('quantizer', shipped['precision'])}",
        source=source,
        dense_ships=shipped.get("dense_ships"),
        fastest_dense=manifest.get("fastest_dense"),
        speedup_b1_vs_fastest_dense=speedup_against(models, manifest.get("fastest_dense")),
        precision=deployed["precision"],
        latency_metric="batch-1 latency",
        latency_b1_ms=deployed["latency_b1_ms"],
        dense_latency_b1_ms=models["dense_fp32"]["latency_b1_ms"],
        speedup_b1=deployed["speedup_b1"],
        speedup_b1_same_precision=same["latency_b1_ms"] / deployed["latency_b1_ms"],
        quality_metric="test accuracy",
        quality=deployed["quality"],
        dense_quality=models["dense_fp32"]["quality"],
        quality_change=accuracy_change(correct["pruned_deployed"], correct["dense_fp32"]).record(),
        size_reduction=models["dense_fp32"]["size_bytes"] / deployed["size_bytes"],
        models=models,
        speedup_b1_deployed_vs_dense=models["pruned_deployed"]["speedup_b1"],
        speedup_b1_pruned_fp32_vs_dense=models["pruned_fp32"]["speedup_b1"],
        machine=machine,
        mac_reduction=models["dense_fp32"]["macs"] / models["pruned_fp32"]["macs"],
        accuracy_delta_points_deployed=100
        * (models["pruned_deployed"]["test_accuracy"] - models["dense_fp32"]["test_accuracy"]),
        slower_than_dense=[n for n, m in models.items() if m["slower_than_dense"]],
        warnings=[gpu_not_timed(gpu)] if gpu else [],
        table=out_dir / "benchmark.md",
    )
    table = markdown_table(models, config.batch_sizes)
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        (tmp / "benchmark.md").write_text(
            f"# Benchmark\n\nONNX Runtime CPU, {config.threads} thread(s), {config.rounds} interleaved rounds x "
            f"{config.repeats} runs after {config.warmup} warm-up, on {machine['cpu']} "
            f"({machine['cpu_features'] or 'CPU features unknown'}).\n\n{table}\n"
            f"TensorRT: {machine['tensorrt']}\n" + "".join(f"\nWarning: {w}\n" for w in report.warnings)
        )
        dump_json(report.metrics(), staged.path(metrics_path))
        plots = staged.dir(plots_dir)
        points = [
            {"name": n, "test_accuracy": m["test_accuracy"], "latency_b1_ms": m["latency"]["1"]["p50_ms"]}
            for n, m in models.items()
        ]
        dump_json(points, plots / "frontier.json")
        plot_frontier(points, plots / "frontier.png", "latency_b1_ms")
    return report
