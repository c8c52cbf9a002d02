"""Command line: `pruneops <stage>` runs one stage with its section of `params.yaml`.

This is the only module that reads `params.yaml` and the command line.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pruneops import __version__
from pruneops.config import check_sections, load_stage_config, parse_section, read_params
from pruneops.errors import DataValidationError, PruneOpsError
from pruneops.io import Layout


@dataclass(frozen=True)
class StageCommand:
    """How the CLI runs one stage and summarises its report in one line."""

    help: str
    run: Callable[[Any, dict, Layout], Any]
    summary: Callable[[Any], str]


def _validate(cfg, params, layout):
    from pruneops.validate import validate_dataset

    return validate_dataset(cfg, layout)


def _train(cfg, params, layout):
    from pruneops.train import train_baseline

    return train_baseline(cfg, layout)


def _sensitivity(cfg, params, layout):
    from pruneops.config import PruneConfig
    from pruneops.sensitivity import analyze_sensitivity

    return analyze_sensitivity(cfg, parse_section("prune", params.get("prune"), PruneConfig), layout)


def _prune(cfg, params, layout):
    from pruneops.prune import prune_iteratively

    return prune_iteratively(cfg, layout)


def _finetune(cfg, params, layout):
    from pruneops.finetune import finetune

    return finetune(cfg, layout)


def _quantize(cfg, params, layout):
    from pruneops.quantize import quantize_model

    return quantize_model(cfg, layout)


def _export(cfg, params, layout):
    from pruneops.export import export_onnx

    return export_onnx(cfg, layout)


def _benchmark(cfg, params, layout):
    from pruneops.benchmark import benchmark_model

    return benchmark_model(cfg, layout)


STAGES: dict[str, StageCommand] = {
    "validate": StageCommand(
        "load, split and check the data (Great Expectations)",
        _validate,
        lambda r: (
            f"{r.dataset}: {r.n_train}/{r.n_val}/{r.n_test} train/val/test, "
            f"{r.expectations_evaluated} expectations passed -> {r.data_dir}"
        ),
    ),
    "train": StageCommand(
        "train the baseline model",
        _train,
        lambda r: (
            f"{r.model}: test accuracy {100 * r.test_accuracy:.2f}%, {r.params:,} params, "
            f"{r.macs:,} MACs -> {r.checkpoint}"
        ),
    ),
    "sensitivity": StageCommand(
        "per-layer sensitivity sweep and ratio allocation",
        _sensitivity,
        lambda r: (
            f"{r.units} units, {r.evaluations} evaluations; allocation for target {r.target_ratio} "
            f"(achieved {r.achieved_ratio:.3f}, summed isolated drop {100 * r.summed_isolated_drop:.1f} pts) "
            f"-> {r.allocation}"
        ),
    ),
    "prune": StageCommand(
        "iterative pruning to the target",
        _prune,
        lambda r: (
            f"{r.method}: {r.mac_reduction:.2f}x fewer MACs, {r.param_reduction:.2f}x fewer params, "
            f"{100 * r.weight_zero_fraction:.1f}% zero weights, val accuracy {100 * r.val_accuracy:.2f}%; "
            f"speed-up: {r.speedup} -> {r.checkpoint}"
        ),
    ),
    "finetune": StageCommand(
        "recovery fine-tuning with distillation",
        _finetune,
        lambda r: (
            f"test accuracy {100 * r.test_accuracy:.2f}% ({r.accuracy_delta_points:+.2f} pts vs baseline), "
            f"{r.mac_reduction:.2f}x fewer MACs -> {r.checkpoint}"
        ),
    ),
    "quantize": StageCommand(
        "ONNX Runtime INT8 quantization",
        _quantize,
        lambda r: (
            f"{r.method}: test accuracy {100 * r.test_accuracy:.2f}% (fp32 {100 * r.fp32_test_accuracy:.2f}%), "
            f"batch-1 {r.latency_ms_b1:.4f} ms (fp32 {r.fp32_latency_ms_b1:.4f} ms) -> {r.model_path}"
        ),
    ),
    "export": StageCommand(
        "ONNX export with parity checks (and TensorRT where present)",
        _export,
        lambda r: (
            f"parity dense {r.dense_max_abs_diff:.1e}, pruned {r.pruned_max_abs_diff:.1e}, "
            f"int8 top-1 agreement {100 * r.int8_agreement:.1f}%; tensorrt: {r.tensorrt} -> {r.export_dir}"
        ),
    ),
    "benchmark": StageCommand(
        "latency/throughput/size/accuracy benchmark",
        _benchmark,
        lambda r: (
            f"batch-1 speed-up vs dense fp32: pruned int8 {r.speedup_b1_pruned_int8_vs_dense:.2f}x, "
            f"pruned fp32 {r.speedup_b1_pruned_fp32_vs_dense:.2f}x; {r.mac_reduction:.2f}x fewer MACs -> {r.table}"
        ),
    ),
}


def _list_registries() -> str:
    import pruneops.models.architectures  # noqa: F401
    from pruneops.data.loaders import LOADERS
    from pruneops.export import ENGINE_BUILDERS
    from pruneops.models import MODELS
    from pruneops.pruning import IMPORTANCES, METHODS, SCHEDULES
    from pruneops.quantize import QUANTIZERS

    lines = []
    for title, reg in [
        ("pruning methods (prune.method)", METHODS),
        ("importance (prune.importance)", IMPORTANCES),
        ("schedules (prune.schedule)", SCHEDULES),
        ("models (train.model)", MODELS),
        ("datasets (validate.dataset)", LOADERS),
        ("quantizers (quantize.method; or auto)", QUANTIZERS),
        ("engine builders", ENGINE_BUILDERS),
    ]:
        lines.append(f"{title}:")
        lines += [f"  {e.name:<12} {e.summary}" for e in reg]
    return "\n".join(lines)


def _launch_data_parallel(args: argparse.Namespace) -> int | None:
    """Re-runs `finetune` under torchrun when `finetune.world_size` > 1; None when not needed."""
    if args.command != "finetune" or "RANK" in os.environ:
        return None
    from pruneops.config import FinetuneConfig

    world = parse_section("finetune", read_params(args.params).get("finetune"), FinetuneConfig).world_size
    if world <= 1:
        return None
    import subprocess

    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc_per_node={world}",
        "-m",
        "pruneops.cli",
        "--params",
        str(args.params),
        "--root",
        str(args.root),
        "finetune",
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, env=env, check=False).returncode


def _registry_dir(args: argparse.Namespace) -> Path:
    from pruneops.config import RepruneConfig

    if args.registry is not None:
        return Path(args.root) / args.registry
    params = read_params(Path(args.root) / args.params)
    return Path(args.root) / parse_section("reprune", params.get("reprune"), RepruneConfig).registry_dir


def _serve(args: argparse.Namespace) -> int:
    import logging

    import uvicorn

    from pruneops.model_registry import PIPELINE_REFERENCE_STATS
    from pruneops.serving.app import ServingConfig, create_app

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        from pruneops.config import RepruneConfig, ServeConfig

        params = read_params(Path(args.root) / args.params)
        serve = parse_section("serve", params.get("serve"), ServeConfig)
        reprune = parse_section("reprune", params.get("reprune"), RepruneConfig)
        settings = serve.model_dump()
        if args.reload_interval is not None:
            settings["reload_interval_s"] = args.reload_interval
        registry = Path(args.root) / (args.registry or reprune.registry_dir)
        config = ServingConfig(
            production=registry / "production",
            reference_stats=Path(args.reference_stats or Path(args.root) / PIPELINE_REFERENCE_STATS),
            feedback_path=Path(args.root) / reprune.feedback_dir / "feedback.npz",
            **settings,
        )
        app = create_app(config)
    except (PruneOpsError, FileNotFoundError) as exc:
        print(f"pruneops serve: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    uvicorn.run(app, host=args.host, port=args.port, log_level="info")
    return 0


def _loadtest(args: argparse.Namespace) -> int:
    import json

    from pruneops.data import load_split
    from pruneops.io import read_json
    from pruneops.serving.loadtest import run_load, tracking_overhead_us

    data_dir = Path(args.root) / "artifacts" / "validate"
    test = load_split(data_dir, "test")
    result = run_load(args.url, test.x, args.requests, args.concurrency)
    summary = result.summary()
    summary["tracking"] = tracking_overhead_us(read_json(data_dir / "reference_stats.json"), test.x)
    print(json.dumps(summary, indent=2))
    return 0 if result.errors == 0 else 1


def _publish(args: argparse.Namespace) -> int:
    import json

    from pruneops.io import read_json
    from pruneops.model_registry import ModelRegistry, git_revision

    root = Path(args.root)
    bench = root / "metrics" / "benchmark.json"
    try:
        registry = ModelRegistry(_registry_dir(args))
        had_production = registry.production() is not None
        version = registry.register_pipeline_model(
            root,
            {
                "git_revision": git_revision(root),
                "reason": "publish",
                "params": read_params(root / args.params),
                "metrics": read_json(bench) if bench.exists() else {},
            },
        )
        promoted = args.promote or not had_production
        if promoted:
            registry.promote(version.version, "published" + (" (forced)" if had_production else " (first model)"))
    except PruneOpsError as exc:
        print(f"pruneops publish: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(json.dumps({"version": version.version, "promoted": promoted, "path": str(version.path)}))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from pruneops.model_registry import ModelRegistry

    try:
        restored = ModelRegistry(_registry_dir(args)).rollback()
    except PruneOpsError as exc:
        print(f"pruneops rollback: error: {exc}", file=sys.stderr)
        return exc.exit_code
    print(f"pruneops rollback: production is now {restored.version}")
    return 0


def _bench(args: argparse.Namespace) -> int:
    import shlex

    import yaml

    from pruneops.bench import BenchConfig, run_benchmarks
    from pruneops.config import parse_section

    root = Path(args.root)
    try:
        raw = yaml.safe_load(Path(args.config).read_text())
        config = parse_section("bench", raw, BenchConfig)
        if args.only:
            config = config.model_copy(update={"workloads": [w for w in config.workloads if w.name in args.only]})
        params = read_params(root / args.params)
        command = "pruneops " + " ".join(shlex.quote(a) for a in args.argv)
        report = run_benchmarks(
            config, params, command, root, log=lambda line: print(f"pruneops bench: {line}", flush=True)
        )
    except (PruneOpsError, FileNotFoundError) as exc:
        print(f"pruneops bench: error: {exc}", file=sys.stderr)
        return getattr(exc, "exit_code", 1)
    for name, pick in report.selected.items():
        print(
            f"pruneops bench: {name}: selected {pick['name']}: test {100 * pick['test_accuracy']:.2f}% "
            f"({-pick['test_drop_points']:+.2f} pts), batch-1 {pick['speedup_b1']:.2f}x faster"
        )
    print(f"pruneops bench: wrote {report.markdown}, {report.plot}, {report.results}")
    return 0


def _methods(_: argparse.Namespace) -> int:
    print(_list_registries())
    return 0


# The sub-commands that are not pipeline stages.
TOOLS: dict[str, Callable[[argparse.Namespace], int]] = {
    "methods": _methods,
    "bench": _bench,
    "serve": _serve,
    "loadtest": _loadtest,
    "publish": _publish,
    "rollback": _rollback,
}


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per stage, plus `methods`)."""
    parser = argparse.ArgumentParser(
        prog="pruneops", description="Prune PyTorch models so they serve faster: one command per DVC stage."
    )
    parser.add_argument("--version", action="version", version=f"pruneops {__version__}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--root", default=".", help="project directory the stages read and write (default: .)")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for name, cmd in STAGES.items():
        sub.add_parser(name, help=cmd.help, description=f"{cmd.help}; reads section `{name}` of params.")
    sub.add_parser("methods", help="list pruning methods, importance criteria, models, quantizers...")
    serve = sub.add_parser("serve", help="serve the production model (FastAPI + ONNX Runtime, /metrics)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--registry", default=None, help="registry directory (default: reprune.registry_dir)")
    serve.add_argument("--reload-interval", type=float, default=None, help="override serve.reload_interval_s")
    serve.add_argument(
        "--reference-stats",
        default=None,
        help="drift reference used until a model brings its own (default: the pipeline's validate output)",
    )
    publish = sub.add_parser(
        "publish",
        help="register the pipeline's pruned INT8 model; promote it if nothing is in production",
        description="Registers artifacts/export/pruned_int8.onnx with its drift reference statistics. "
        "It becomes production only when there is none (first deployment) or with --promote; "
        "later models go through the re-prune flow's promotion gate.",
    )
    publish.add_argument("--registry", default=None, help="registry directory (default: reprune.registry_dir)")
    publish.add_argument("--promote", action="store_true", help="promote even over an existing production model")
    load = sub.add_parser("loadtest", help="bounded load test of a running `pruneops serve` on loopback")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--requests", type=int, default=5000)
    load.add_argument("--concurrency", type=int, default=8)
    bench = sub.add_parser(
        "bench",
        help="benchmark recipes side by side (frontier table and plot in docs/)",
        description="Runs each workload's variants through the pipeline's stages (sharing one baseline), "
        "times every model interleaved in one process, and writes docs/benchmarks.md.",
    )
    bench.add_argument("--config", default="benchmarks/mnist.yaml", help="benchmark definition (YAML)")
    bench.add_argument("--only", nargs="*", default=None, help="run only these workloads")
    rollback = sub.add_parser("rollback", help="restore the production model that preceded the current one")
    rollback.add_argument("--registry", default=None, help="registry directory (default: reprune.registry_dir)")
    return parser


def run_stage(stage: str, params_path: str | Path, root: str | Path = ".") -> Any:
    """Validates the stage's params, then runs it (raises `PruneOpsError` on failure)."""
    params = read_params(params_path)
    check_sections(params)
    config = load_stage_config(params, stage)
    return STAGES[stage].run(config, params, Layout(Path(root)))


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pruneops` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if args.command in TOOLS:
        return TOOLS[args.command](args)
    started = time.perf_counter()
    try:
        launched = _launch_data_parallel(args)
        if launched is not None:
            return launched
        report = run_stage(args.command, args.params, args.root)
    except PruneOpsError as exc:
        print(f"pruneops {args.command}: error: {exc}", file=sys.stderr)
        if isinstance(exc, DataValidationError):
            print("\n".join(exc.details), file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print(f"pruneops {args.command}: interrupted; no output written", file=sys.stderr)
        return 130
    except Exception as exc:  # noqa: BLE001 - last resort: one line unless debugging
        if os.environ.get("PRUNEOPS_DEBUG"):
            traceback.print_exc()
        print(
            f"pruneops {args.command}: internal error: {type(exc).__name__}: {exc} "
            "(set PRUNEOPS_DEBUG=1 for a traceback)",
            file=sys.stderr,
        )
        return 1
    if os.environ.get("RANK", "0") == "0":
        print(f"pruneops {args.command} ({time.perf_counter() - started:.1f}s): {STAGES[args.command].summary(report)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
