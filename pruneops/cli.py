"""Command line: `pruneops <stage>` runs one stage of the table with its section of `params.yaml`.

This is the only module that reads the command line. Stage commands come from
`pruneops.pipeline.stages.STAGES`; the other commands (`TOOLS`) are thin calls into the library.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path

from pruneops import __version__
from pruneops.core.errors import DataValidationError, PruneOpsError
from pruneops.core.progress import LOG_FORMAT, show_progress
from pruneops.pipeline.runner import StageOutcome, record_outcome, run_stage
from pruneops.pipeline.stages import STAGES, get_stage


def _error_line(command: str, exc: BaseException) -> str:
    return f"pruneops {command}: error: {exc}"


def _print_error(command: str, exc: BaseException) -> int:
    print(_error_line(command, exc), file=sys.stderr)
    if isinstance(exc, DataValidationError):
        print("\n".join(exc.details), file=sys.stderr)
    return getattr(exc, "exit_code", 1)


def _file_error(exc: OSError) -> str:
    """One line for an operating-system error: the file and the reason, never the file's contents."""
    where = exc.filename if exc.filename is not None else "a file"
    return f"{where}: {exc.strerror or type(exc).__name__}"[:300]


def _list_registries() -> str:
    from pruneops.data.loaders import LOADERS
    from pruneops.models import MODELS
    from pruneops.models.registry import resolve_factory
    from pruneops.pruning.importance import IMPORTANCES
    from pruneops.pruning.methods import METHODS
    from pruneops.pruning.schedule import SCHEDULES
    from pruneops.runtimes.onnxruntime.quantizers import QUANTIZERS
    from pruneops.task.classification.export import ENGINE_BUILDERS

    resolve_factory("cnn")  # registers the built-in architectures
    lines = []
    for title, reg in [
        ("pruning methods (prune.method)", METHODS),
        ("importance (prune.importance, sensitivity.importance)", IMPORTANCES),
        ("schedules (prune.schedule)", SCHEDULES),
        ("models (train.model; or package.module:factory)", MODELS),
        ("datasets (validate.dataset)", LOADERS),
        ("quantizers (quantize.method; or auto)", QUANTIZERS),
        ("engine builders", ENGINE_BUILDERS),
    ]:
        lines.append(f"{title}:")
        lines += [f"  {e.name:<16} {e.summary}" for e in reg]
    return "\n".join(lines)


def _launch_data_parallel(args: argparse.Namespace) -> int | None:
    """Re-runs `finetune` under torchrun for more than one process; None when not needed.

    One node: `--standalone`. Several (`finetune.nnodes`): a c10d rendezvous at
    `finetune.rdzv_endpoint`, which each node's `pruneops finetune` joins.
    """
    if args.command != "finetune" or "RANK" in os.environ:
        return None
    from pruneops.pipeline.stages import load_stage_configs, project_importable

    with project_importable(args.root):
        config = load_stage_configs(args.params, "finetune")["finetune"]
    if config.nproc_per_node * config.nnodes <= 1:
        return None
    import subprocess

    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={config.nproc_per_node}"]
    if config.nnodes == 1:
        cmd.append("--standalone")
    else:
        cmd += [f"--nnodes={config.nnodes}", "--rdzv_backend=c10d", f"--rdzv_endpoint={config.rdzv_endpoint}"]
        cmd += [f"--rdzv_id={config.rdzv_id}"]
    cmd += ["-m", "pruneops.cli", "--params", str(args.params), "--root", str(args.root), "finetune"]
    return subprocess.run(cmd, env={**os.environ, "OMP_NUM_THREADS": "1"}, check=False).returncode


def _serve(args: argparse.Namespace) -> int:
    import logging

    from pruneops.serving.app import app_from_params
    from pruneops.serving.limits import run_server

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    app = app_from_params(
        Path(args.root),
        args.params,
        args.registry,
        reload_interval_s=args.reload_interval,
        reference=args.reference_stats,
    )
    run_server(app, args.host, args.port, app.state.serving.config.read_timeout_s)
    return 0


def _serve_decoder(args: argparse.Namespace) -> int:
    import logging

    from pruneops.data.drift import prompt_reference
    from pruneops.pipeline.stages import load_section
    from pruneops.serving.generate import DecoderService, ServeLimits, create_decoder_app
    from pruneops.serving.limits import run_server

    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT)
    feedback = Path(args.feedback_file) if args.feedback_file else None
    params = Path(args.root) / args.params
    threshold = load_section(args.root, "serve", args.params).psi_threshold if params.is_file() else 0.2
    gate = load_section(args.root, "reprune", args.params) if params.is_file() else None
    limits = ServeLimits(args.max_waiting, args.deadline, args.max_prompt_tokens, args.prefill_budget)
    options = {
        "feedback_file": feedback,
        "psi_threshold": threshold,
        "decode_slo_ms": gate.decode_slo_ms if gate else None,
        "prefill_slo_ms": gate.prefill_slo_ms if gate else None,
        "limits": limits,
    }
    if args.registry:
        from pruneops.serving.decoder_service import production_service
        from pruneops.serving.generate import follow_production

        service = production_service(Path(args.registry), **options)
        follow_production(service, Path(args.registry), args.reload_interval)
    else:
        service = DecoderService(Path(args.model), None, **options)
    if args.reference:
        from pruneops.data.corpus import read_documents

        documents = read_documents(args.reference, args.text_column)
        service.watch_prompts(prompt_reference([service.encode(d) for d in documents]))
    served_name = args.served_model_name or Path(args.registry or args.model).resolve().name
    run_server(create_decoder_app(service, served_name), args.host, args.port, args.read_timeout)
    return 0


def _loadtest(args: argparse.Namespace) -> int:
    import json

    from pruneops.core.io import Layout, read_json
    from pruneops.data import load_split
    from pruneops.serving.loadtest import run_load, tracking_overhead_us

    data_dir = Layout(Path(args.root)).stage_dir("validate")
    test = load_split(data_dir, "test")
    result = run_load(args.url, test.x, args.requests, args.concurrency)
    summary = result.summary()
    summary["tracking"] = tracking_overhead_us(read_json(data_dir / "reference_stats.json"), test.x)
    print(json.dumps(summary, indent=2))
    return 0 if result.errors == 0 else 1


def _publish(args: argparse.Namespace) -> int:
    import json

    from pruneops.modelstore.store import publish_pipeline_model

    published = publish_pipeline_model(
        Path(args.root),
        args.params,
        args.registry,
        force_promote=args.promote,
        allow_contract_change=args.allow_contract_change,
    )
    print(json.dumps(published))
    return 0


def _rollback(args: argparse.Namespace) -> int:
    from pruneops.modelstore.store import registry_from_params

    registry = registry_from_params(Path(args.root), args.params, args.registry)
    restored = registry.rollback(allow_contract_change=args.allow_contract_change)
    print(f"pruneops rollback: production is now {restored.version}")
    return 0


def _recover(args: argparse.Namespace) -> int:
    import json

    from pruneops.modelstore.store import registry_from_params

    print(json.dumps(registry_from_params(Path(args.root), args.params, args.registry).recover()))
    return 0


def _bench(args: argparse.Namespace) -> int:
    import shlex

    from pruneops.compare.run import run_bench_file

    show_progress()  # its own long steps (the interleaved timing and scoring of every row) log as the stages' do
    command = "pruneops " + " ".join(shlex.quote(a) for a in args.argv)
    report = run_bench_file(
        Path(args.config), Path(args.root), args.params, command, args.only, args.variants, args.out_dir
    )
    for name, pick in report.selected.items():
        if "test_accuracy" in pick:
            quality = f"test {100 * pick['test_accuracy']:.2f}% ({-pick['test_drop_points']:+.2f} pts)"
        else:
            quality = f"test perplexity {100 * pick['test_change']['value']:+.1f} %"
        print(f"pruneops bench: {name}: selected {pick['name']}: {quality}, batch-1 {pick['speedup_b1']:.2f}x faster")
    for name, where in report.reports.items():
        print(f"pruneops bench: {name}: wrote {where / 'report.md'} (results.json and plots beside it)")
    print("pruneops bench: `pruneops reference` rebuilds docs/results.md and the README's table from the reports")
    return 0


def _dvc_yaml(args: argparse.Namespace) -> int:
    from pruneops.pipeline.dvcfile import check_dvc_yaml, write_dvc_yaml

    root = Path(args.root)
    if args.check:
        problems = check_dvc_yaml(root, args.params)
        for line in problems:
            print(f"pruneops dvc-yaml: {line}", file=sys.stderr)
        return 1 if problems else 0
    path = write_dvc_yaml(root, args.params)
    print(f"pruneops dvc-yaml: wrote {path}")
    return 0


def _reference(args: argparse.Namespace) -> int:
    from pruneops.reports.pages import generated_files, stale_files, write_files

    files = generated_files(Path(args.root), build_parser(), args.out)
    if args.check:
        stale = stale_files(files)
        for path in stale:
            print(f"pruneops reference: {path} is stale (run pruneops reference)", file=sys.stderr)
        return 1 if stale else 0
    written = write_files(files)
    for path in written:
        print(f"pruneops reference: wrote {path}")
    if not written:
        print(f"pruneops reference: all {len(files)} generated files are current")
    return 0


def _doctor(args: argparse.Namespace) -> int:
    from pruneops.core.io import Layout
    from pruneops.timing.doctor import diagnose

    findings = diagnose(
        Layout(Path(args.root)), passes=args.passes, emit=lambda line: print(f"pruneops doctor: {line}")
    )
    warned = sum(not f.ok for f in findings)
    print(f"pruneops doctor: {warned} warning(s)" if warned else "pruneops doctor: timings here can carry the gates")
    return 0


def _methods(_: argparse.Namespace) -> int:
    print(_list_registries())
    return 0


# The sub-commands that are not pipeline stages.
TOOLS: dict[str, Callable[[argparse.Namespace], int]] = {
    "methods": _methods,
    "bench": _bench,
    "serve-decoder": _serve_decoder,
    "serve": _serve,
    "loadtest": _loadtest,
    "publish": _publish,
    "rollback": _rollback,
    "recover": _recover,
    "dvc-yaml": _dvc_yaml,
    "reference": _reference,
    "doctor": _doctor,
}


def _add_tools(sub: argparse._SubParsersAction) -> None:
    sub.add_parser("methods", help="list pruning methods, importance criteria, models, quantizers...")
    serve = sub.add_parser("serve", help="serve the production model (FastAPI + ONNX Runtime, /metrics)")
    serve.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--reload-interval", type=float, default=None, help="override serve.reload_interval_s")
    serve.add_argument("--reference-stats", default=None, help="drift reference until a model brings its own")
    serve_decoder = sub.add_parser(
        "serve-decoder",
        help="serve a decoder LLM (genai or GGUF folder): the OpenAI API, /generate, /feedback, /metrics",
    )
    source = serve_decoder.add_mutually_exclusive_group(required=True)
    source.add_argument("--model", help="an export folder: onnxruntime-genai's, or llama.cpp's GGUF (export stage)")
    source.add_argument("--registry", help="a model registry: serve its production decoder, follow promotions")
    serve_decoder.add_argument(
        "--reference",
        default=None,
        help="a corpus file: prompt drift is measured against it (default with "
        "--registry: the version's own reference)",
    )
    serve_decoder.add_argument("--feedback-file", default=None, help="append /feedback texts here (JSONL, `text`)")
    serve_decoder.add_argument("--reload-interval", type=float, default=2.0, help="seconds between production checks")
    serve_decoder.add_argument("--text-column", default="text", help="the corpus's text column (tables)")
    serve_decoder.add_argument("--host", default="127.0.0.1", help="bind address (default: loopback only)")
    serve_decoder.add_argument("--port", type=int, default=8001)
    serve_decoder.add_argument("--read-timeout", type=float, default=10.0, help="seconds to read a request")
    serve_decoder.add_argument(
        "--served-model-name", default=None, help="the model id of the OpenAI API (default: the folder's name)"
    )
    serve_decoder.add_argument("--max-waiting", type=int, default=32, help="queued requests beyond which 429")
    serve_decoder.add_argument("--deadline", type=float, default=300.0, help="seconds a generation may run")
    serve_decoder.add_argument(
        "--max-prompt-tokens", type=int, default=None, help="prompt bound (default: what --prefill-budget reads)"
    )
    serve_decoder.add_argument(
        "--prefill-budget", type=float, default=10.0, help="seconds one prompt's prefill may take (measured at load)"
    )
    publish = sub.add_parser(
        "publish",
        help="register the pipeline's deployed model; promote it if nothing is in production",
        description="Registers the pipeline's exported model with its drift reference statistics. It becomes "
        "production only when there is none (first deployment) or with --promote.",
    )
    publish.add_argument("--promote", action="store_true", help="promote even over an existing production model")
    rollback = sub.add_parser("rollback", help="restore the production model that preceded the current one")
    for p in (publish, rollback):
        p.add_argument(
            "--allow-contract-change",
            action="store_true",
            help="make production a model that serves other inputs or classes (clients must follow)",
        )
    recover = sub.add_parser(
        "recover",
        help="rebuild a consistent registry: readable history, production at its top, no leftovers",
    )
    for p in (serve, publish, rollback, recover):
        p.add_argument("--registry", default=None, help="registry directory (default: reprune.registry_dir)")
    load = sub.add_parser("loadtest", help="bounded load test of a running `pruneops serve` on loopback")
    load.add_argument("--url", default="http://127.0.0.1:8000")
    load.add_argument("--requests", type=int, default=5000)
    load.add_argument("--concurrency", type=int, default=8)
    bench = sub.add_parser(
        "bench",
        help="benchmark recipes side by side (one report per workload under docs/results)",
        description="Runs each workload's variants as DVC experiments (sharing the baseline through the "
        "run-cache), times every model interleaved in one process, and writes each workload's report "
        "to <out_dir>/<workload>/report.md.",
    )
    bench.add_argument("--config", default="benchmarks/mnist.yaml", help="benchmark definition (YAML)")
    bench.add_argument("--only", nargs="*", default=None, help="run only these workloads")
    bench.add_argument(
        "--variants",
        nargs="*",
        default=None,
        help="run only these variants (with the dense ones and those they match)",
    )
    bench.add_argument("--out-dir", default=None, help="write the report here instead of the config's out_dir")
    doctor = sub.add_parser(
        "doctor",
        help="whether this machine's timings can carry the gates: its load, timing noise and drift, the table's fit",
        description="Times fresh sessions of one model (the project's dense export, or a small stand-in) side by "
        "side, pass after pass, and reads how well the latency table predicted held-out exports and the kept plan.",
    )
    doctor.add_argument("--passes", type=int, default=4, help="timing passes (default 4)")
    dvc = sub.add_parser("dvc-yaml", help="write dvc.yaml from the stage table (deps = what each stage imports)")
    dvc.add_argument("--check", action="store_true", help="only check dvc.yaml; exit 1 naming what is stale")
    ref = sub.add_parser(
        "reference",
        help="write the reference pages (params, CLI, metrics, stages) from the code, and the results page",
    )
    ref.add_argument("--out", default="docs/reference", help="folder under --root (default: docs/reference)")
    ref.add_argument("--check", action="store_true", help="only check the pages; exit 1 naming what is stale")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser (one sub-command per stage, plus the tools)."""
    parser = argparse.ArgumentParser(
        prog="pruneops", description="Prune PyTorch models so they serve faster: one command per DVC stage."
    )
    parser.add_argument("--version", action="version", version=f"pruneops {__version__}")
    parser.add_argument("--params", default="params.yaml", help="params file (default: params.yaml)")
    parser.add_argument("--root", default=".", help="project directory the stages read and write (default: .)")
    sub = parser.add_subparsers(dest="command", metavar="command", required=True)
    for stage in STAGES:
        sub.add_parser(stage.name, help=stage.help, description=f"{stage.help}; reads section `{stage.name}`.")
    _add_tools(sub)
    return parser


def _run_tool(args: argparse.Namespace) -> int:
    try:
        return TOOLS[args.command](args)
    except PruneOpsError as exc:
        return _print_error(args.command, exc)
    except OSError as exc:
        return _print_error(args.command, PruneOpsError(_file_error(exc)))


def _run_stage_command(args: argparse.Namespace) -> int:
    """Runs the stage and records how it ended (`pipeline.runner.StageOutcome`)."""
    started = time.perf_counter()
    code, error = _run_stage_reporting(args, started)
    if error is not None and os.environ.get("RANK", "0") == "0":
        record_outcome(args.root, StageOutcome(args.command, code, error, round(time.perf_counter() - started, 3)))
    return code


def _run_stage_reporting(args: argparse.Namespace, started: float) -> tuple[int, str | None]:
    """The stage's exit code and its one error line (empty on success), printed as they happen.

    The error is None where the stage ran under torchrun: its rank-0 process recorded the outcome.
    """
    show_progress()
    try:
        launched = _launch_data_parallel(args)
        if launched is not None:
            return launched, None
        report = run_stage(args.command, args.params, args.root)
    except PruneOpsError as exc:
        return _print_error(args.command, exc), _error_line(args.command, exc)
    except KeyboardInterrupt:
        print(f"pruneops {args.command}: interrupted; no output written", file=sys.stderr)
        return 130, f"pruneops {args.command}: interrupted"
    except OSError as exc:  # a file that cannot be read or written: name it, in one line
        error = PruneOpsError(_file_error(exc))
        return _print_error(args.command, error), _error_line(args.command, error)
    except Exception as exc:  # noqa: BLE001 - last resort: one line unless debugging
        if os.environ.get("PRUNEOPS_DEBUG"):
            traceback.print_exc()
        line = f"pruneops {args.command}: internal error: {type(exc).__name__}: {exc}"
        print(f"{line} (set PRUNEOPS_DEBUG=1 for a traceback)", file=sys.stderr)
        return 1, line
    if os.environ.get("RANK", "0") == "0":
        print(f"pruneops {args.command} ({time.perf_counter() - started:.1f}s): {report.summary()}")
        for line in report.warning_lines:
            print(f"pruneops {args.command}: warning: {line}", file=sys.stderr)
    return 0, ""


def main(argv: list[str] | None = None) -> int:
    """Entry point of the `pruneops` console script; returns the exit code."""
    args = build_parser().parse_args(argv)
    args.argv = list(sys.argv[1:] if argv is None else argv)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    os.environ.setdefault("DO_NOT_TRACK", "1")
    if args.command in TOOLS:
        return _run_tool(args)
    get_stage(args.command)
    return _run_stage_command(args)


if __name__ == "__main__":
    sys.exit(main())
