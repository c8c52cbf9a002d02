"""`pruneops bench`: the accuracy-latency frontier of several recipes, measured side by side.

Each workload (a model on a dataset) trains one baseline and sweeps its sensitivity once; each
variant then runs the pipeline's own stages (prune, finetune, quantize, export) in its own
directory with its params overrides, sharing the baseline. All exported models are then timed in
one process, interleaved round by round, so that machine drift falls on every model alike.
Variants that are already done (same params) are reused: an interrupted run loses nothing.
"""

from __future__ import annotations

import copy
import hashlib
import importlib
import json
import os
import platform
import shutil
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any, Literal

import numpy as np
from pydantic import BaseModel, ConfigDict, Field

from pruneops.config import BenchmarkConfig, check_sections, load_stage_config
from pruneops.errors import ConfigError, PruneOpsError
from pruneops.io import Layout, dump_json, read_json

# Which stages a variant kind runs after the shared baseline (validate, train, sensitivity).
VARIANT_STAGES: dict[str, tuple[str, ...]] = {
    "dense": ("quantize", "export"),
    "pruned": ("prune", "finetune", "quantize", "export"),
}


class VariantConfig(BaseModel):
    """One recipe: dotted params overrides on top of the workload's params.

    `match_macs_of` names an earlier variant: this one's `prune.target_ratio` is then chosen so
    that its pruned model has no more MACs than that variant's (same MAC budget).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    kind: Literal["dense", "pruned"] = "pruned"
    family: Literal["dense", "naive", "torch_pruning", "ours"] = "ours"
    label: str = ""
    set: dict[str, Any] = Field(default_factory=dict)
    match_macs_of: str | None = None


class WorkloadConfig(BaseModel):
    """A model on a dataset, its params (nested sections) and the variants to compare."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: str
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    max_accuracy_drop_points: Annotated[float, Field(ge=0)] = 0.3
    # What the selected point must reach: speedup_b1, throughput_gain (largest batch), size_reduction.
    targets: dict[Literal["speedup_b1", "throughput_gain", "size_reduction"], float] = Field(default_factory=dict)
    variants: list[VariantConfig]


class BenchConfig(BaseModel):
    """The whole benchmark: where to work, how to time, which workloads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: str = "state/bench"
    out_dir: str = "docs"
    timing: dict[str, Any] = Field(default_factory=dict)
    recipes: dict[str, dict[str, Any]] = Field(default_factory=dict)  # YAML anchors shared by variants
    workloads: list[WorkloadConfig]


@dataclass(frozen=True)
class BenchReport:
    """Rows per workload, the selected points, failed variants, and where the outputs went."""

    rows: dict[str, list[dict]]
    selected: dict[str, dict]
    failed: dict[str, dict[str, str]]
    markdown: Path
    plot: Path
    results: Path


def set_dotted(params: dict[str, Any], key: str, value: Any) -> None:
    """`params["prune"]["target_ratio"] = value` from `"prune.target_ratio"`."""
    section, _, leaf = key.partition(".")
    if not leaf:
        raise ConfigError(f"bench override {key!r}: expected section.key")
    params.setdefault(section, {})[leaf] = value


def _merged(base: dict[str, Any], nested: dict[str, dict], dotted: dict[str, Any]) -> dict[str, Any]:
    params = copy.deepcopy(base)
    for section, values in nested.items():
        params.setdefault(section, {}).update(copy.deepcopy(values))
    for key, value in dotted.items():
        set_dotted(params, key, value)
    check_sections(params)
    return params


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()[:16]


# The pipeline's stage functions, each `(config, layout)`; sensitivity also takes the prune section.
STAGE_FUNCTIONS: dict[str, tuple[str, str]] = {
    "validate": ("pruneops.validate", "validate_dataset"),
    "train": ("pruneops.train", "train_baseline"),
    "sensitivity": ("pruneops.sensitivity", "analyze_sensitivity"),
    "prune": ("pruneops.prune", "prune_iteratively"),
    "finetune": ("pruneops.finetune", "finetune"),
    "quantize": ("pruneops.quantize", "quantize_model"),
    "export": ("pruneops.export", "export_onnx"),
}


def _run_stage(stage: str, params: dict[str, Any], layout: Layout) -> Any:
    module, name = STAGE_FUNCTIONS[stage]
    function = getattr(importlib.import_module(module), name)
    config = load_stage_config(params, stage)
    if stage == "sensitivity":
        return function(config, load_stage_config(params, "prune"), layout)
    return function(config, layout)


def _link(src: Path, dst: Path) -> None:
    if dst.is_symlink() or dst.exists():
        if dst.is_symlink() or dst.is_file():
            dst.unlink()
        else:
            shutil.rmtree(dst)
    dst.parent.mkdir(parents=True, exist_ok=True)
    os.symlink(os.path.relpath(src, dst.parent), dst)


def reallocate_(sensitivity_dir: Path, target: float, dst_dir: Path, max_ratio: float | None = None) -> float:
    """Writes an allocation for `target` from an existing sweep (no new evaluations).

    Args:
        sensitivity_dir: The sweep (`sensitivity.json`, `allocation.json`).
        target: The weighted fraction to remove.
        dst_dir: Where the variant's `sensitivity.json` and `allocation.json` go.
        max_ratio: No unit loses more than this (default: the sweep's `max_layer_ratio`).

    Returns:
        The weighted ratio the allocation reaches.
    """
    from pruneops.pruning import allocate_ratios
    from pruneops.pruning.allocation import achieved_ratio

    sweep = read_json(sensitivity_dir / "sensitivity.json")
    alloc = read_json(sensitivity_dir / "allocation.json")
    max_ratio = alloc["max_layer_ratio"] if max_ratio is None else max_ratio
    ratios = allocate_ratios(sweep["units"], alloc["weights"], target, max_ratio)
    achieved = achieved_ratio(ratios, alloc["weights"])
    if achieved + 1e-9 < target:
        raise ConfigError(
            f"prune.target_ratio: {target} is out of reach of the sweep (at most {achieved:.3f} with units capped "
            f"at {max_ratio})"
        )
    dst_dir.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(sensitivity_dir / "sensitivity.json", dst_dir / "sensitivity.json")
    dump_json(
        {**alloc, "target_ratio": target, "achieved_ratio": achieved, "ratios": ratios}, dst_dir / "allocation.json"
    )
    return achieved


def predicted_macs(base: Layout, params: dict[str, Any], target: float) -> int:
    """MACs of the baseline pruned at `target` with the sweep's allocation (no training)."""
    import torch

    from pruneops.checkpoint import load_checkpoint
    from pruneops.data import load_prepared
    from pruneops.profiling import count_macs
    from pruneops.pruning import IMPORTANCES, METHODS
    from pruneops.pruning.methods import PruneContext

    prune = load_stage_config(params, "prune")
    meta, train, val, _ = load_prepared(base.stage_dir("validate"))
    model = load_checkpoint(base.stage_dir("train") / "model.safetensors").model
    scratch = Path(base.root) / ".predict"
    max_ratio = load_stage_config(params, "sensitivity").max_layer_ratio
    reallocate_(base.stage_dir("sensitivity"), target, scratch, max_ratio)
    allocation = read_json(scratch / "allocation.json")["ratios"]
    shutil.rmtree(scratch, ignore_errors=True)
    ctx = PruneContext(
        target_ratio=target,
        criterion=IMPORTANCES.get(prune.importance),
        example_input=torch.from_numpy(val.x[:1]),
        train=train,
        allocation=allocation,
        round_to=prune.round_to,
        batch_size=prune.batch_size,
    )
    METHODS.get(prune.method)(ctx).apply_(model, 1.0)
    return count_macs(model, meta.input_shape)


def target_for_macs(base: Layout, params: dict[str, Any], budget: int, iterations: int = 10) -> float:
    """The smallest `prune.target_ratio` whose predicted MACs are within `budget` (bisection).

    Raises:
        ConfigError: No target the sweep can reach (under the variant's allocation cap) fits.
    """
    low, high, found = 0.0, 0.98, None
    for _ in range(iterations):
        mid = (low + high) / 2
        try:
            fits = predicted_macs(base, params, mid) <= budget
        except ConfigError:
            # Out of the sweep's reach: the answer, if any, lies below.
            high = mid
            continue
        if fits:
            high, found = mid, mid
        else:
            low = mid
    if found is None:
        raise ConfigError(
            f"no prune.target_ratio the sweep can reach gives {budget:,} MACs or fewer; "
            "raise sensitivity.max_layer_ratio or add higher sensitivity.ratios"
        )
    return round(found, 4)


# Options added after runs were recorded, keyed only when on so that those runs stay valid.
_KEYED_WHEN_ON = (("sensitivity", "bn_recalibration_samples"), ("prune", "bn_recalibration_samples"))


def _keyed(params: dict[str, Any]) -> dict[str, Any]:
    """A copy of `params` without the `_KEYED_WHEN_ON` options that are off (0)."""
    keyed = copy.deepcopy(params)
    for section, key in _KEYED_WHEN_ON:
        if key in keyed.get(section, {}) and not keyed[section][key]:
            del keyed[section][key]
    return keyed


def _variant_digest(vparams: dict[str, Any], kind: str, trained_digest: str, base_digest: str) -> str:
    """What a variant's results depend on: the sweep only if it allocates from it."""
    keyed = _keyed(vparams)
    uses_sweep = kind == "pruned" and keyed.get("prune", {}).get("use_sensitivity", True)
    return _digest(base_digest if uses_sweep else trained_digest, keyed, kind)


def _done(marker: Path, digest: str) -> bool:
    return marker.exists() and read_json(marker).get("digest") == digest


def prepare_workload(
    work: Path, workload: WorkloadConfig, base_params: dict[str, Any], log: Callable[[str], None]
) -> tuple[dict[str, Path], dict[str, str]]:
    """Runs the shared baseline and every variant's stages.

    A variant whose stage fails (a quality gate, an unreachable target) is reported and the
    others go on.

    Returns:
        Each finished variant's directory, and why each failed variant failed.
    """
    params = _merged(base_params, workload.params, {})
    base = Layout(work / "base")
    # The allocation cap (max_layer_ratio) is each variant's choice; the sweep does not depend on it.
    sweep = {k: v for k, v in _keyed(params).get("sensitivity", {}).items() if k != "max_layer_ratio"}
    if "bn_recalibration_samples" in sweep:  # its draw of samples follows prune.seed
        sweep["bn_recalibration"] = [sweep.pop("bn_recalibration_samples"), params["prune"].get("seed", 0)]
    # Each shared stage is keyed by what it depends on, so a changed sweep does not retrain.
    trained_digest = _digest(params.get("validate"), params.get("train"))
    base_digest = _digest(params.get("validate"), params.get("train"), sweep, params["prune"]["method"])
    marker = base.root / "done.json"
    if not _done(marker, base_digest):
        base.root.mkdir(parents=True, exist_ok=True)
        stages = ("validate", "train", "sensitivity")
        if marker.exists() and read_json(marker).get("trained") == trained_digest:
            stages = ("sensitivity",)
        for stage in stages:
            started = time.perf_counter()
            _run_stage(stage, params, base)
            log(f"[{workload.name}] base: {stage} done in {time.perf_counter() - started:.0f} s")
        dump_json({"digest": base_digest, "trained": trained_digest}, marker)
    dirs: dict[str, Path] = {}
    failed: dict[str, str] = {}
    macs_of: dict[str, int] = {}
    names = [v.name for v in workload.variants]
    for variant in workload.variants:
        overrides = dict(variant.set)
        if variant.match_macs_of is not None:
            if variant.match_macs_of not in names[: names.index(variant.name)]:
                raise ConfigError(
                    f"bench variant {variant.name}: match_macs_of {variant.match_macs_of!r} must be an earlier variant"
                )
            if variant.match_macs_of not in macs_of:
                failed[variant.name] = f"{variant.match_macs_of} failed, so there is no MAC budget to match"
                continue
            vparams = _merged(params, {}, overrides)
            overrides["prune.target_ratio"] = target_for_macs(base, vparams, macs_of[variant.match_macs_of])
            log(f"[{workload.name}] {variant.name}: target_ratio {overrides['prune.target_ratio']} for the same MACs")
        vparams = _merged(params, {}, overrides)
        layout = Layout(work / variant.name)
        digest = _variant_digest(vparams, variant.kind, trained_digest, base_digest)
        vmarker = layout.root / "done.json"
        if not _done(vmarker, digest):
            if layout.root.exists():
                shutil.rmtree(layout.root)
            for stage in ("validate", "train"):
                _link(base.stage_dir(stage), layout.stage_dir(stage))
            if variant.kind == "dense":
                layout.stage_dir("finetune").mkdir(parents=True)
                shutil.copyfile(
                    base.stage_dir("train") / "model.safetensors", layout.stage_dir("finetune") / "model.safetensors"
                )
            stage = "sensitivity"
            try:
                prune = load_stage_config(vparams, "prune")
                if variant.kind == "pruned" and prune.use_sensitivity:
                    reallocate_(
                        base.stage_dir("sensitivity"),
                        prune.target_ratio,
                        layout.stage_dir("sensitivity"),
                        load_stage_config(vparams, "sensitivity").max_layer_ratio,
                    )
                for stage in VARIANT_STAGES[variant.kind]:
                    started = time.perf_counter()
                    _run_stage(stage, vparams, layout)
                    log(f"[{workload.name}] {variant.name}: {stage} done in {time.perf_counter() - started:.0f} s")
            except PruneOpsError as exc:
                failed[variant.name] = f"{stage}: {exc}"
                log(f"[{workload.name}] {variant.name}: skipped: {failed[variant.name]}")
                continue
            dump_json({"digest": digest, "params": vparams}, vmarker)
        dirs[variant.name] = layout.root
        manifest = read_json(layout.stage_dir("export") / "manifest.json")
        macs_of[variant.name] = manifest["models"]["pruned_fp32"]["macs"]
    return dirs, failed


def _latency(t: np.ndarray, batch: int) -> dict[str, float]:
    return {
        "p50_ms": float(np.percentile(t, 50)),
        "p99_ms": float(np.percentile(t, 99)),
        "throughput": float(batch / (t.mean() / 1e3)),
    }


def measure_workload(
    work: Path, workload: WorkloadConfig, dirs: dict[str, Path], timing: BenchmarkConfig
) -> list[dict]:
    """Accuracy, size, MACs and interleaved ONNX Runtime latency of every model of a workload."""
    from pruneops.benchmark import measure_latencies
    from pruneops.checkpoint import load_checkpoint
    from pruneops.data import load_prepared
    from pruneops.onnx_utils import file_size, make_session, ort_accuracy
    from pruneops.profiling import count_nonzero_params

    _, _, val, test = load_prepared(work / "base" / "artifacts" / "validate")
    models: dict[str, dict] = {}
    for variant in (v for v in workload.variants if v.name in dirs):
        export = dirs[variant.name] / "artifacts" / "export"
        manifest = read_json(export / "manifest.json")["models"]
        nonzero = count_nonzero_params(
            load_checkpoint(dirs[variant.name] / "artifacts" / "finetune" / "model.safetensors").model
        )
        picks = [("dense_fp32", "fp32"), ("pruned_int8", "int8")] if variant.kind == "dense" else []
        picks = picks or [("pruned_fp32", "fp32"), ("pruned_int8", "int8")]
        for file_key, precision in picks:
            m = manifest[file_key]
            name = f"{variant.name} {precision}"
            models[name] = {
                "name": name,
                "variant": variant.name,
                "family": variant.family,
                "label": variant.label or variant.name,
                "precision": precision,
                "path": export / m["file"],
                "params": m["params"],
                "nonzero_params": nonzero if variant.kind == "pruned" else m["params"],
                "macs": m["macs"],
                "size_bytes": file_size(export / m["file"]),
            }
    sessions = {n: make_session(m["path"], timing.threads) for n, m in models.items()}
    samples = measure_latencies(sessions, test.x, timing)
    for name, m in models.items():
        m["val_accuracy"] = ort_accuracy(sessions[name], val.x, val.y)
        m["test_accuracy"] = ort_accuracy(sessions[name], test.x, test.y)
        m["latency"] = {str(b): _latency(t, b) for b, t in samples[name].items()}
        m["path"] = str(m["path"])
    dense = next(m for m in models.values() if m["family"] == "dense" and m["precision"] == "fp32")
    big = str(max(timing.batch_sizes))
    for m in models.values():
        m["speedup_b1"] = dense["latency"]["1"]["p50_ms"] / m["latency"]["1"]["p50_ms"]
        m[f"throughput_gain_b{big}"] = m["latency"][big]["throughput"] / dense["latency"][big]["throughput"]
        m["mac_reduction"] = dense["macs"] / m["macs"]
        m["size_reduction"] = dense["size_bytes"] / m["size_bytes"]
        # How much of the ideal (speed-up = MAC reduction) the measured speed-up reaches.
        m["speedup_per_mac_reduction"] = m["speedup_b1"] / m["mac_reduction"]
        m["val_drop_points"] = 100 * (dense["val_accuracy"] - m["val_accuracy"])
        m["test_drop_points"] = 100 * (dense["test_accuracy"] - m["test_accuracy"])
    return list(models.values())


def select_point(rows: list[dict], max_drop_points: float) -> dict | None:
    """Our fastest model (batch 1) whose *validation* accuracy drop is within the budget."""
    ours = [r for r in rows if r["family"] == "ours" and r["val_drop_points"] <= max_drop_points + 1e-9]
    return min(ours, key=lambda r: r["latency"]["1"]["p50_ms"]) if ours else None


def markdown_rows(rows: list[dict], big: str) -> str:
    """The per-model table of one workload."""
    head = [
        "model",
        "val acc (%)",
        "test acc (%)",
        "Δ test (pts)",
        "params (nonzero)",
        "MACs",
        "size (KiB)",
        "b1 p50 / p99 (ms)",
        f"b{big} p50 / p99 (ms)",
        f"b{big} throughput (/s)",
        "b1 speed-up",
        f"b{big} thr. gain",
        "MAC red.",
        "speed-up / MAC red.",
    ]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        b1, bb = r["latency"]["1"], r["latency"][big]
        lines.append(
            "| "
            + " | ".join(
                [
                    f"{r['label']} {r['precision']}",
                    f"{100 * r['val_accuracy']:.2f}",
                    f"{100 * r['test_accuracy']:.2f}",
                    f"{-r['test_drop_points']:+.2f}",
                    f"{r['params']:,} ({r['nonzero_params']:,})",
                    f"{r['macs']:,}",
                    f"{r['size_bytes'] / 1024:.1f}",
                    f"{b1['p50_ms']:.3f} / {b1['p99_ms']:.3f}",
                    f"{bb['p50_ms']:.2f} / {bb['p99_ms']:.2f}",
                    f"{bb['throughput']:,.0f}",
                    f"{r['speedup_b1']:.2f}×",
                    f"{r[f'throughput_gain_b{big}']:.2f}×",
                    f"{r['mac_reduction']:.2f}×",
                    f"{r['speedup_per_mac_reduction']:.2f}",
                ]
            )
            + " |"
        )
    return "\n".join(lines) + "\n"


def pareto_front(rows: list[dict]) -> list[dict]:
    """The rows no other row beats on both batch-1 latency and test accuracy, fastest first."""
    front, best = [], -1.0
    for r in sorted(rows, key=lambda r: (r["latency"]["1"]["p50_ms"], -r["test_accuracy"])):
        if r["test_accuracy"] > best:
            front.append(r)
            best = r["test_accuracy"]
    return front


def plot_frontiers(rows: dict[str, list[dict]], path: Path) -> None:
    """Test accuracy vs batch-1 latency, one panel per workload; our recipe's Pareto front joined."""
    from pruneops.plots import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, len(rows), figsize=(6.5 * len(rows), 4.8), squeeze=False)
    colors = {"dense": "black", "naive": "tab:red", "torch_pruning": "tab:orange", "ours": "tab:blue"}
    names = {"dense": "dense", "naive": "naive 90% unstructured", "torch_pruning": "Torch-Pruning", "ours": "PruneOps"}
    for ax, (workload, items) in zip(axes[0], rows.items(), strict=True):
        front = pareto_front([r for r in items if r["family"] == "ours"])
        ax.plot(
            [r["latency"]["1"]["p50_ms"] for r in front],
            [100 * r["test_accuracy"] for r in front],
            "-",
            color="tab:blue",
            alpha=0.5,
            label="PruneOps front",
        )
        for family, color in colors.items():
            for precision, marker in (("fp32", "o"), ("int8", "s")):
                pts = [r for r in items if r["family"] == family and r["precision"] == precision]
                if pts:
                    ax.scatter(
                        [r["latency"]["1"]["p50_ms"] for r in pts],
                        [100 * r["test_accuracy"] for r in pts],
                        color=color,
                        marker=marker,
                        s=45,
                        facecolors="none" if precision == "fp32" else color,
                        label=f"{names[family]} {precision}",
                    )
        for r in items:
            ax.annotate(
                r["label"],
                (r["latency"]["1"]["p50_ms"], 100 * r["test_accuracy"]),
                textcoords="offset points",
                xytext=(4, 3),
                fontsize=7,
            )
        ax.set_xscale("log")
        ax.set_xlabel("batch-1 p50 latency (ms, ONNX Runtime CPU, log); hollow fp32, filled int8")
        ax.set_ylabel("test accuracy (%)")
        ax.set_title(workload)
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=7, loc="lower right")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def machine_info(threads: int) -> dict[str, Any]:
    """What the figures were measured on."""
    import onnxruntime
    import torch

    from pruneops.benchmark import _cpu_name

    return {
        "cpu": _cpu_name(),
        "cores": os.cpu_count(),
        "ort_threads": threads,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "onnxruntime": onnxruntime.__version__,
        "date": time.strftime("%Y-%m-%d"),
    }


def run_benchmarks(
    config: BenchConfig,
    base_params: dict[str, Any],
    command: str,
    root: Path = Path("."),
    log: Callable[[str], None] = print,
) -> BenchReport:
    """Runs every workload's variants, measures them together and writes the report.

    Args:
        config: The benchmark (workloads, variants, timing).
        base_params: The project's params (every stage section), which workloads override.
        command: The command line that reproduces this run (written into the report).
        root: Directory that `work_dir` and `out_dir` are relative to.
        log: Progress sink (one line per finished stage).

    Returns:
        The report; `<out_dir>/benchmarks.md`, `<out_dir>/benchmarks/frontier.png` and
        `<out_dir>/benchmarks/results.json`.
    """
    timing = BenchmarkConfig(**config.timing)
    rows: dict[str, list[dict]] = {}
    selected: dict[str, dict] = {}
    failed: dict[str, dict[str, str]] = {}
    for workload in config.workloads:
        work = root / config.work_dir / workload.name
        dirs, failed[workload.name] = prepare_workload(work, workload, base_params, log)
        log(f"[{workload.name}] timing {2 * len(dirs)} models, interleaved")
        rows[workload.name] = measure_workload(work, workload, dirs, timing)
        pick = select_point(rows[workload.name], workload.max_accuracy_drop_points)
        if pick is not None:
            selected[workload.name] = pick
    out = root / config.out_dir
    plot = out / "benchmarks" / "frontier.png"
    plot_frontiers(rows, plot)
    results = out / "benchmarks" / "results.json"
    machine = machine_info(timing.threads)
    dump_json(
        {"machine": machine, "timing": timing.model_dump(), "rows": rows, "selected": selected, "failed": failed},
        results,
    )
    markdown = out / "benchmarks.md"
    markdown.write_text(render_markdown(config, rows, selected, failed, machine, timing, command))
    return BenchReport(rows, selected, failed, markdown, plot, results)


def render_markdown(
    config: BenchConfig,
    rows: dict[str, list[dict]],
    selected: dict[str, dict],
    failed: dict[str, dict[str, str]],
    machine: dict[str, Any],
    timing: BenchmarkConfig,
    command: str,
) -> str:
    """The report: command, machine, per-workload tables and the selected points."""
    big = str(max(timing.batch_sizes))
    parts = [
        "# Benchmarks: the accuracy–latency frontier\n",
        f"Reproduce: `{command}`\n",
        f"Machine: {machine['cpu']}, {machine['cores']} cores; ONNX Runtime {machine['onnxruntime']} CPU, "
        f"{timing.threads} thread(s); torch {machine['torch']}; Python {machine['python']}; {machine['date']}. "
        f"Latency: {timing.rounds} interleaved rounds × {timing.repeats} runs after {timing.warmup} warm-up per model "
        f"and batch size, all models in one process.\n",
        "Accuracy drops are against the dense fp32 model of the same workload. The selected point is our "
        "fastest model whose **validation** accuracy drop is within the budget; its test figures are "
        "reported as they came.\n",
        "![frontier](benchmarks/frontier.png)\n",
    ]
    for workload in config.workloads:
        items = rows[workload.name]
        parts.append(f"## {workload.name}\n")
        parts.append(markdown_rows(items, big))
        for name, why in failed.get(workload.name, {}).items():
            parts.append(f"- {name}: not measured — {why}")
        pick = selected.get(workload.name)
        if pick is None:
            parts.append(
                f"\nNo structured model stayed within {workload.max_accuracy_drop_points} point(s) on validation.\n"
            )
            for key, goal in workload.targets.items():
                parts.append(f"- target {key} ≥ {goal:g}×: **missed** (no point within the accuracy budget)")
        else:
            parts.append(
                f"\n**Selected** (validation drop ≤ {workload.max_accuracy_drop_points} pt): {pick['label']} "
                f"{pick['precision']}: test {100 * pick['test_accuracy']:.2f}% ({-pick['test_drop_points']:+.2f} pts), "
                f"batch-1 {pick['speedup_b1']:.2f}× faster, batch-{big} throughput "
                f"{pick[f'throughput_gain_b{big}']:.2f}×, file {pick['size_reduction']:.1f}× smaller, "
                f"{pick['mac_reduction']:.2f}× fewer MACs (speed-up / MAC reduction "
                f"{pick['speedup_per_mac_reduction']:.2f}).\n"
            )
            achieved = {
                "speedup_b1": pick["speedup_b1"],
                "throughput_gain": pick[f"throughput_gain_b{big}"],
                "size_reduction": pick["size_reduction"],
            }
            # Chosen on validation; the targets are stated on test, so its test drop must hold too.
            within = pick["test_drop_points"] <= workload.max_accuracy_drop_points + 1e-9
            if not within:
                parts.append(
                    f"- its test drop ({pick['test_drop_points']:.2f} pts) exceeds the "
                    f"{workload.max_accuracy_drop_points} pt budget: every target below is **missed** for it"
                )
            for key, goal in workload.targets.items():
                verdict = "met" if achieved[key] >= goal and within else "**missed**"
                parts.append(f"- target {key} ≥ {goal:g}×: {achieved[key]:.2f}× — {verdict}")
        measured = {r["variant"] for r in items}
        for variant in workload.variants:
            if variant.match_macs_of is None or not {variant.name, variant.match_macs_of} <= measured:
                continue
            for precision in ("fp32", "int8"):
                mine = next(r for r in items if r["variant"] == variant.name and r["precision"] == precision)
                other = next(r for r in items if r["variant"] == variant.match_macs_of and r["precision"] == precision)
                verdict = "equal or better" if mine["test_accuracy"] >= other["test_accuracy"] else "**worse**"
                parts.append(
                    f"- same MAC budget, {precision}: {mine['label']} {100 * mine['test_accuracy']:.2f}% test "
                    f"({100 * mine['val_accuracy']:.2f}% val, {mine['macs']:,} MACs) vs {other['label']} "
                    f"{100 * other['test_accuracy']:.2f}% test ({100 * other['val_accuracy']:.2f}% val, "
                    f"{other['macs']:,} MACs): {verdict}"
                )
        parts.append("")
    return "\n".join(parts)
