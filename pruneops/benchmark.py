"""`benchmark` stage: latency, throughput, size and accuracy of every exported model."""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.data import load_prepared
from pruneops.errors import DataError
from pruneops.inputs import as_feed
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.onnx_utils import file_size, make_session, ort_accuracy
from pruneops.plots import plot_frontier
from pruneops.stages import StageReport


@dataclass(frozen=True)
class BenchmarkReport(StageReport):
    """Per-model figures and the headline speed-ups."""

    models: dict
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


def cpu_name() -> str:
    """The CPU model, from /proc/cpuinfo where there is one."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


# Instruction-set extensions that change which kernels ONNX Runtime and torch run (and so what a
# width costs): a virtual machine named a Zen 3 and a Zen 4 alike ("AMD EPYC"); the default
# pipeline's static INT8 model ran 2.4-2.7x dense fp32 at batch 1 on the Zen 3 (no VNNI: 7-bit
# weights) and 3.5-4.1x in four runs on the Zen 4 (AVX-512 VNNI: 8-bit).
KERNEL_FLAGS = (
    "avx2",
    "fma",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx_vnni",
    "avx512_bf16",
    "amx_int8",
    "amx_bf16",
    "asimd",
    "asimddp",
    "i8mm",
    "sve",
)


def cpu_features(cpuinfo: Path = Path("/proc/cpuinfo")) -> str:
    """The CPU's family/model numbers and kernel-relevant extensions from `cpuinfo` ("" without one).

    E.g. `family 25 model 17: avx2 fma avx512f avx512bw avx512_vnni avx512_bf16`; on Arm the
    first core's `Features` (`asimd asimddp i8mm`).
    """
    try:
        lines = cpuinfo.read_text().splitlines()
    except OSError:
        return ""
    fields: dict[str, str] = {}
    for line in lines:
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    flags = set((fields.get("flags") or fields.get("Features") or "").split())
    ident = " ".join(f"{k.removeprefix('cpu ')} {fields[k]}" for k in ("cpu family", "model") if k in fields)
    present = " ".join(f for f in KERNEL_FLAGS if f in flags)
    return f"{ident}: {present}" if ident else present


def cuda_device() -> str | None:
    """The name of the CUDA device torch sees here, or None (nothing in the pipeline times one)."""
    import torch

    return torch.cuda.get_device_name() if torch.cuda.is_available() else None


def gpu_not_timed(gpu: str) -> str:
    """The warning where the machine has a GPU: every latency of the pipeline is ONNX Runtime on its CPU."""
    return (
        f"a CUDA device is here ({gpu}), but nothing in this pipeline ran on it: the latency table, the prune gate, "
        "quantize's choice and these figures are ONNX Runtime on the CPU, and the served model runs there too; "
        "widths fast on this CPU can run slower than dense on a GPU (on an H100 a 14-channel block did: docs/gpu), "
        "so time the model on the GPU before serving it there"
    )


def _repeat(x: np.ndarray, size: int) -> np.ndarray:
    reps = -(-size // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:size])


def _batch(x: np.ndarray | dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """A feed of `size` samples: `x` repeated as needed (plain or named inputs)."""
    if isinstance(x, dict):
        return {k: _repeat(v, size) for k, v in x.items()}
    return as_feed(_repeat(x, size))


MIN_TURNS = 10  # fewest timed runs per model under a time budget: a median still means something
SELF_WARMING_RUN_S = 0.02  # a run at least this long is timed without an untimed run before it


def measure_latencies(
    sessions: dict, x: np.ndarray, config: BenchmarkConfig, budget_s: float | None = None
) -> dict[str, dict[int, np.ndarray]]:
    """Latency samples (ms) per model and batch size, `rounds * repeats` each, interleaved run by run.

    Each turn times every model once, the order rotating from turn to turn, so that machine drift
    (clock frequency, other load) falls on every model alike: identical models measured this way
    agree to about 0.5% here, where blocks of runs per model disagreed by up to 20% at 50 µs.

    Args:
        sessions: ONNX Runtime sessions by name.
        x: One sample (plain or named inputs), repeated to each batch size.
        config: Batch sizes, warm-up, repeats and rounds.
        budget_s: At most about this many seconds of timed turns per batch size (at least
            `MIN_TURNS` turns), judged from the warm-up runs: for gates inside a stage, where a
            transformer's large batch (MiniLM: ~0.4 s a run) would otherwise take minutes.
            None: `rounds * repeats` turns (the benchmark).
    """
    names = list(sessions)
    samples: dict[str, dict[int, np.ndarray]] = {n: {} for n in names}
    for b in config.batch_sizes:
        feed = _batch(x, b)
        run_s = {}
        for name in names:
            for _ in range(max(1, config.warmup)):
                started = time.perf_counter()
                sessions[name].run(None, feed)
            run_s[name] = time.perf_counter() - started
        # One untimed run before each timed one: the timed one then finds this model's weights in
        # cache, as a server running it request after request does, whatever ran in between here
        # (timed cold, small models measured up to 20% slower among 30 others than among 3). A run
        # of tens of milliseconds streams its weights many times over and warms itself: no pair.
        paired = {n: run_s[n] < SELF_WARMING_RUN_S for n in names}
        turn_s = sum((2 if paired[n] else 1) * run_s[n] for n in names)
        turns = config.rounds * config.repeats
        if budget_s is not None:
            turns = min(turns, max(MIN_TURNS, int(budget_s / turn_s)))
        times = {n: np.empty(turns) for n in names}
        for turn in range(turns):
            k = turn % len(names)
            for name in names[k:] + names[:k]:
                if paired[name]:
                    sessions[name].run(None, feed)
                started = time.perf_counter()
                sessions[name].run(None, feed)
                times[name][turn] = time.perf_counter() - started
        for name in names:
            samples[name][b] = times[name] * 1e3
    return samples


def latency_summary(samples_ms: np.ndarray, batch: int) -> dict[str, float]:
    """Percentiles, mean and throughput of one model's latency samples at one batch size."""
    t = np.asarray(samples_ms)
    return {
        "p50_ms": float(np.percentile(t, 50)),
        "p95_ms": float(np.percentile(t, 95)),
        "p99_ms": float(np.percentile(t, 99)),
        "mean_ms": float(t.mean()),
        "throughput": float(batch / (t.mean() / 1e3)),
    }


Column = tuple[str, Callable[[dict], str]]


def render_table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table: one row per item, each column a (header, formatter) pair."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def latency_columns(batch_sizes: list[int], digits: int = 4) -> list[Column]:
    """p50/p99 per batch size, then the largest batch's throughput."""
    cols: list[Column] = []
    for b in batch_sizes:
        cols.append((f"b{b} p50 / p99 (ms)", lambda r, b=b: _p50_p99(r["latency"][str(b)], digits)))
    big = str(max(batch_sizes))
    cols.append((f"b{big} throughput (/s)", lambda r: f"{r['latency'][big]['throughput']:,.0f}"))
    return cols


def _p50_p99(lat: dict, digits: int) -> str:
    return f"{lat['p50_ms']:.{digits}f} / {lat['p99_ms']:.{digits}f}"


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


def machine_info(threads: int) -> dict[str, Any]:
    """What the figures were measured on."""
    import onnxruntime

    return {
        "cpu": cpu_name(),
        "cpu_features": cpu_features(),
        "cores": os.cpu_count(),
        "threads": threads,
        "python": platform.python_version(),
        "onnxruntime": onnxruntime.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


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
    sessions = {name: make_session(export_dir / m["file"], config.threads) for name, m in manifest["models"].items()}
    samples = measure_latencies(sessions, test.x, config)
    models: dict[str, dict] = {}
    for name, m in manifest["models"].items():
        latency = {str(b): latency_summary(t, b) for b, t in samples[name].items()}
        models[name] = {
            "precision": m["precision"],
            "params": m["params"],
            "macs": m["macs"],
            "size_bytes": file_size(export_dir / m["file"]),
            "test_accuracy": ort_accuracy(sessions[name], test.x, test.y),
            "latency": latency,
        }
    dense = models["dense_fp32"]["latency"]
    for m in models.values():
        m["speedup_b1"] = dense["1"]["p50_ms"] / m["latency"]["1"]["p50_ms"]
        # Slower than dense fp32 at any batch size is a regression the report must show.
        m["slower_than_dense"] = any(m["latency"][b]["p50_ms"] > dense[b]["p50_ms"] for b in dense)
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
    report = BenchmarkReport(
        models=models,
        speedup_b1_deployed_vs_dense=models["pruned_deployed"]["speedup_b1"],
        speedup_b1_pruned_fp32_vs_dense=models["pruned_fp32"]["speedup_b1"],
        mac_reduction=models["dense_fp32"]["macs"] / models["pruned_fp32"]["macs"],
        accuracy_delta_points_deployed=100
        * (models["pruned_deployed"]["test_accuracy"] - models["dense_fp32"]["test_accuracy"]),
        slower_than_dense=[n for n, m in models.items() if m["slower_than_dense"]],
        machine=machine,
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
