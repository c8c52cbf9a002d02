"""`benchmark` stage: latency, throughput, size and accuracy of every exported model."""

from __future__ import annotations

import platform
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.data import load_prepared
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.onnx_utils import file_size, make_session, ort_accuracy, time_session
from pruneops.plots import plot_frontier


@dataclass(frozen=True)
class BenchmarkReport:
    """Per-model figures and the headline speed-ups."""

    models: dict
    speedup_b1_pruned_int8_vs_dense: float
    speedup_b1_pruned_fp32_vs_dense: float
    mac_reduction: float
    accuracy_delta_points_int8: float
    machine: dict
    table: Path

    def metrics(self) -> dict:
        """The figures tracked by `dvc metrics`."""
        return {k: v for k, v in self.__dict__.items() if k != "table"}


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _batch(x: np.ndarray, size: int) -> np.ndarray:
    reps = -(-size // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:size])


def measure_latencies(sessions: dict, x: np.ndarray, config: BenchmarkConfig) -> dict[str, dict[int, np.ndarray]]:
    """Latency samples (ms) per model and batch size, interleaved round by round.

    Interleaving spreads machine drift (frequency, other load) over every model alike.
    """
    samples: dict[str, dict[int, list]] = {n: {b: [] for b in config.batch_sizes} for n in sessions}
    names = list(sessions)
    for r in range(config.rounds):
        order = names[r % len(names) :] + names[: r % len(names)]
        for name in order:
            for b in config.batch_sizes:
                samples[name][b].append(time_session(sessions[name], _batch(x, b), config.repeats, config.warmup))
    return {n: {b: np.concatenate(v) for b, v in per.items()} for n, per in samples.items()}


def markdown_table(models: dict, batch_sizes: list[int]) -> str:
    """The benchmark as a markdown table."""
    big = max(batch_sizes)
    head = ["model", "test acc (%)", "params", "MACs", "size (KiB)"]
    for b in batch_sizes:
        head += [f"b{b} p50 (ms)", f"b{b} p99 (ms)"]
    head += [f"throughput b{big} (samples/s)", "b1 speed-up"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, m in models.items():
        row = [
            name,
            f"{100 * m['test_accuracy']:.2f}",
            f"{m['params']:,}",
            f"{m['macs']:,}",
            f"{m['size_bytes'] / 1024:.1f}",
        ]
        for b in batch_sizes:
            lat = m["latency"][str(b)]
            row += [f"{lat['p50_ms']:.4f}", f"{lat['p99_ms']:.4f}"]
        row += [f"{m['latency'][str(big)]['throughput']:,.0f}", f"{m['speedup_b1']:.2f}x"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines) + "\n"


def benchmark_model(config: BenchmarkConfig, layout: Layout | None = None) -> BenchmarkReport:
    """Benchmarks dense fp32, pruned fp32 and pruned int8 in one process with ONNX Runtime CPU.

    Each model gets the same thread count, warm-up and repeats; rounds are interleaved.

    Returns:
        The report; `metrics/benchmark.json`, `artifacts/benchmark/benchmark.md` and
        `plots/benchmark/frontier.png`.
    """
    layout = layout or Layout()
    _, _, _, test = load_prepared(layout.stage_dir("validate"))
    export_dir = layout.stage_dir("export")
    manifest = read_json(export_dir / "manifest.json")
    sessions = {name: make_session(export_dir / m["file"], config.threads) for name, m in manifest["models"].items()}
    samples = measure_latencies(sessions, test.x, config)
    models: dict[str, dict] = {}
    for name, m in manifest["models"].items():
        latency = {}
        for b, t in samples[name].items():
            latency[str(b)] = {
                "p50_ms": float(np.percentile(t, 50)),
                "p95_ms": float(np.percentile(t, 95)),
                "p99_ms": float(np.percentile(t, 99)),
                "mean_ms": float(t.mean()),
                "throughput": float(b / (t.mean() / 1e3)),
            }
        models[name] = {
            "precision": m["precision"],
            "params": m["params"],
            "macs": m["macs"],
            "size_bytes": file_size(export_dir / m["file"]),
            "test_accuracy": ort_accuracy(sessions[name], test.x, test.y),
            "latency": latency,
        }
    dense_b1 = models["dense_fp32"]["latency"]["1"]["p50_ms"]
    for m in models.values():
        m["speedup_b1"] = dense_b1 / m["latency"]["1"]["p50_ms"]
    trt = manifest.get("tensorrt", {})
    machine = {
        "cpu": _cpu_name(),
        "threads": config.threads,
        "python": platform.python_version(),
        "onnxruntime": __import__("onnxruntime").__version__,
        "tensorrt": "; ".join(f"{k}: {v['status']} — {v.get('reason', '')}" for k, v in trt.items()) or "not requested",
    }
    out_dir, metrics_path, plots_dir = (
        layout.stage_dir("benchmark"),
        layout.metrics("benchmark"),
        layout.plots("benchmark"),
    )
    report = BenchmarkReport(
        models=models,
        speedup_b1_pruned_int8_vs_dense=models["pruned_int8"]["speedup_b1"],
        speedup_b1_pruned_fp32_vs_dense=models["pruned_fp32"]["speedup_b1"],
        mac_reduction=models["dense_fp32"]["macs"] / models["pruned_fp32"]["macs"],
        accuracy_delta_points_int8=100
        * (models["pruned_int8"]["test_accuracy"] - models["dense_fp32"]["test_accuracy"]),
        machine=machine,
        table=out_dir / "benchmark.md",
    )
    table = markdown_table(models, config.batch_sizes)
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        (tmp / "benchmark.md").write_text(
            f"# Benchmark\n\nONNX Runtime CPU, {config.threads} thread(s), {config.rounds} interleaved rounds x "
            f"{config.repeats} runs after {config.warmup} warm-up, on {machine['cpu']}.\n\n{table}\n"
            f"TensorRT: {machine['tensorrt']}\n"
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
