"""`pruneops bench`: the accuracy-latency frontier of several recipes, measured side by side.

Each workload (a model on a dataset) is a DVC project of its own under `work_dir` (its
`params.yaml` is the project's params with the workload's sections over them; its `dvc.yaml`
comes from the stage table). Each variant is a DVC experiment on it (`pruneops.pipeline.experiments`):
the run-cache shares what variants have in common, so the baseline is trained once and the
sweep measured once, and a variant whose params did not change restores instead of re-running.
All exported models are then timed in one process, interleaved round by round, so that machine
drift falls on every model alike; `pruneops.compare.report` selects and writes the report.
"""

from __future__ import annotations

import copy
import os
import shutil
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from pruneops.compare.workloads import BenchConfig, VariantConfig, WorkloadConfig, dense_overrides, quick_overrides
from pruneops.config import AUTO_FORM, BenchmarkConfig
from pruneops.core.errors import ConfigError, PruneOpsError
from pruneops.core.io import Layout, dump_json, read_json
from pruneops.core.params import parse_section, read_params
from pruneops.core.progress import progress_text
from pruneops.data.zero_shot import ZERO_SHOT_FILE
from pruneops.pipeline.experiments import apply_overrides, run_experiment, tool_env
from pruneops.pipeline.stages import STAGE_NAMES, STAGES, project_importable

# In each variant's results: the stages DVC restored from its run-cache or found unchanged.
NOT_RUN = "stages_not_run.json"


@dataclass(frozen=True)
class BenchReport:
    """Rows per workload, the selected points, failed variants, and where the outputs went."""

    rows: dict[str, list[dict]]
    selected: dict[str, dict]
    failed: dict[str, dict[str, str]]
    # Each workload's directory: `report.md`, `results.json`, `frontier.png` (see `pruneops.compare.report`).
    reports: dict[str, Path]


def workload_params(base: dict[str, Any], workload: WorkloadConfig, root: Path) -> dict[str, Any]:
    """The project's params with the workload's sections over them; file paths made absolute.

    Every file the stage table says a stage of the workload's task reads (`UserFile`: the data,
    its tokenizer, general text, a zero-shot check, the starting weights) is named relative to the
    project; each workload runs in its own directory.
    """
    base_task = (base.get("train") or {}).get("task", "classification")
    # A workload of the other task starts from that task's defaults: the project's keys would be refused.
    params = {k: dict(v) if isinstance(v, dict) else v for k, v in base.items()} if base_task == workload.task else {}
    for section, values in copy.deepcopy(workload.params).items():
        params.setdefault(section, {}).update(values)
    for key in dict.fromkeys(f.key for stage in STAGES for f in stage.impl(workload.task).files):
        *blocks, name = key.split(".")
        node = params
        for block in blocks:
            node = node.get(block) if isinstance(node, dict) else None
        if isinstance(node, dict) and node.get(name):
            node[name] = str((root / node[name]).resolve())
    return apply_overrides(params, {})


def prepare_repo(repo: Path, params: dict[str, Any], root: Path) -> None:
    """Makes `repo` a git + DVC project with these params and its generated `dvc.yaml`, committed."""
    from pruneops.pipeline.dvcfile import write_dvc_yaml

    repo.mkdir(parents=True, exist_ok=True)
    env = tool_env()
    if not (repo / ".git").exists():
        subprocess.run(["git", "init", "-q"], cwd=repo, env=env, check=True)
    if not (repo / ".dvc").exists():
        subprocess.run([shutil.which("dvc", path=env["PATH"]) or "dvc", "init", "-q"], cwd=repo, env=env, check=True)
    for ignore in (".gitignore", ".dvcignore"):  # experiment worktrees and kept results
        (repo / ignore).write_text("/state/\n/results/\n__pycache__/\n")
    (repo / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    with project_importable(root):
        write_dvc_yaml(repo)
    # Only what this function writes: the outputs of a variant restored into the workspace (`dvc exp
    # apply`, to look at one) are DVC's to track, and committed they fail every later experiment
    # ("output 'artifacts/validate' is already tracked by SCM").
    written = [".gitignore", ".dvcignore", "params.yaml", "dvc.yaml", ".dvc"]
    subprocess.run(["git", "add", "--", *written], cwd=repo, env=env, check=True)
    if subprocess.run(["git", "diff", "--cached", "--quiet"], cwd=repo, env=env).returncode:
        subprocess.run(["git", "commit", "-qm", "workload params"], cwd=repo, env=env, check=True)


def match_form(variant: VariantConfig, other: dict) -> str:
    """The form a latency match is in: the variant's `prune.target.form`, else the one `other` was timed in.

    Args:
        variant: The matching variant.
        other: The matched variant's metrics (by stage).
    """
    return variant.set.get("prune.target.form", other["prune"].get("latency_form", "fp32"))


def variant_overrides(
    variant: VariantConfig, done: dict[str, dict], reference: Path | None = None, task: str = "classification"
) -> dict[str, Any]:
    """The variant's overrides, with what its kind and MAC or latency matching add.

    Args:
        variant: The variant.
        done: Each finished earlier variant's metrics (by stage).
        reference: For `match_latency_of`, the matched variant's export in `match_form`
            (`reference_to_match`), the prune stage's `target_reference`; None: the ratio to
            dense that variant's prune stage measured for its planned widths.
        task: The workload's task (what a dense variant and every variant override).

    Raises:
        ConfigError: It matches a variant that failed or is not earlier, or a prune-stage reading
            taken in another form than the one it asks for.
    """
    overrides = {**quick_overrides(task), **(dense_overrides(task) if variant.kind == "dense" else {}), **variant.set}
    for other in (variant.match_macs_of, variant.match_latency_of):
        if other is not None and other not in done:
            raise ConfigError(f"{variant.name}: matches {other!r}, which is not a finished earlier variant")
    if variant.match_macs_of is not None:
        macs = done[variant.match_macs_of]["prune"]["macs"]
        overrides.update({"prune.target.kind": "macs", "prune.target.value": float(macs), "prune.target.batch": None})
    if variant.match_latency_of is not None:
        prune = done[variant.match_latency_of]["prune"]
        form = match_form(variant, done[variant.match_latency_of])
        if form == AUTO_FORM:
            raise ConfigError(
                f"{variant.name}: a latency match is timed in one form; set prune.target.form to fp32 or a "
                f"quantizer's name, not {AUTO_FORM}"
            )
        ratio = 1.0
        if reference is None:
            ratio = prune["measured_ms"]["1"] / prune["dense_ms"]["1"]
            # A stage's reading holds in the form it was timed in; a variant timing another would aim wrong.
            timed = prune.get("latency_form", "fp32")
            if form != timed:
                raise ConfigError(
                    f"{variant.name}: prune.target.form {form} cannot match the latency of "
                    f"{variant.match_latency_of!r}, timed in {timed} by its prune stage "
                    f"(the bench timed no {form} exports of both rows)"
                )
        # Aimed at the other row's time itself: the prune stage accepts a reading up to
        # `LATENCY_BAND[1]` of it (1% over: one reading's noise, half the bench's
        # `SLOWER_TOLERANCE`). Aimed under it by that much, the other row's own widths would
        # measure over the aim and be refused (docs/explanation/latency-targets.md#band).
        overrides.update({"prune.target.kind": "latency_ratio", "prune.target.value": ratio, "prune.target.batch": 1})
        if reference is not None:
            overrides["prune.target.reference"] = str(reference)
        if form != "fp32":  # the default: left unwritten, so that params (and the run-cache) stay as they were
            overrides["prune.target.form"] = form
    return overrides


def timed_file(directory: Path, form: str, dense: bool) -> Path | None:
    """A variant's exported model in `form`: its fp32 export, or its deployed one if deployed in that form.

    Args:
        directory: The variant's results directory.
        form: `fp32` or a quantizer's name.
        dense: The dense model's export (a dense variant's) rather than the pruned one.

    Returns:
        The file, or None where the variant's deployed model is in another form.
    """
    export = Layout(directory).stage_dir("export")
    models = read_json(export / "manifest.json")["models"]
    if form == "fp32":
        return export / models["dense_fp32" if dense else "pruned_fp32"]["file"]
    deployed = models.get("pruned_deployed", {})  # a dense variant's "pruned" model is its dense one
    return export / deployed["file"] if deployed.get("quantizer") == form else None


def reference_to_match(
    variant: VariantConfig, dirs: dict[str, Path], done: dict[str, dict], log: Callable[[str], None]
) -> Path | None:
    """The matched variant's export that a latency match is timed against, in `match_form`; None if it has none.

    The prune stage times it beside dense and each plan (`prune.target.reference`): a ratio of
    the two read once moves with the machine (docs/explanation/latency-targets.md#bench-match).
    """
    other = variant.match_latency_of
    if other is None or other not in done:
        return None
    form = match_form(variant, done[other])
    reference = timed_file(dirs[other], form, dense=False) if form != AUTO_FORM else None
    if reference is None:
        log(f"{variant.name}: matching {other}'s latency as its prune stage measured it (not deployed in {form})")
        return None
    kind = "fp32 export" if form == "fp32" else f"export deployed in {form}"
    log(f"{variant.name}: matching {other}'s batch-1 latency, its {kind} timed in every gate reading")
    return reference.resolve()


# What a variant was measured on, kept beside its exports: a classifier's splits, a causal LM's blocks and
# its zero-shot check (without which the bench's rows would have no zero-shot figures).
MEASURED_DATA = ("val.npz", "test.npz", "corpus.npz", ZERO_SHOT_FILE)


def keep_measured_data(validate: Path, keep: Path) -> list[str]:
    """Puts each of `MEASURED_DATA` that `validate` wrote into `keep` (hard links: not copied per variant).

    Returns:
        The names kept.
    """
    keep.mkdir(parents=True)
    kept = [name for name in MEASURED_DATA if (validate / name).is_file()]
    for name in kept:
        _link_or_copy(validate / name, keep / name)
    return kept


def _link_or_copy(src: Path, dst: Path) -> None:
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copyfile(src, dst)


class StageLines:
    """Which of a variant's output lines `pruneops bench` shows, and as what.

    Which stages ran and which the run-cache restored; epochs, plans and runoffs; and the progress of
    long steps (`pruneops.core.progress`: scoring, calibration, recovery, export), each step's at most
    once every `every_s` seconds and always its last line, so a long stage can be told from a hung one.

    Args:
        every_s: Seconds between two relayed progress lines of one step.
        clock: The time source (injected in tests).
    """

    def __init__(self, every_s: float = 60.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.every_s, self.clock = every_s, clock
        self.last: dict[str, float] = {}  # each step's last relayed progress line

    def __call__(self, line: str) -> str | None:
        """The text to show for `line`, or None to leave it out."""
        if line.startswith("Running stage") or "skipping run" in line or "didn't change" in line:
            return line
        if " pruneops.training.fit: " in line or " pruneops.task.classification.prune: latency " in line:
            return line.split(" pruneops.", 1)[1].split(": ", 1)[1]
        text = progress_text(line)
        if text is None:
            return None
        step, now = text.split(": ", 1)[0], self.clock()
        if " done in " not in text and now - self.last.get(step, -float("inf")) < self.every_s:
            return None
        self.last[step] = now
        return text


def run_variant(
    repo: Path, variant: VariantConfig, overrides: dict[str, Any], log: Callable[[str], None], pythonpath=()
) -> Path:
    """Runs one variant as a DVC experiment and keeps what the timing needs under `results/`."""
    relay = StageLines()

    def stage_lines(line: str) -> None:
        text = relay(line)
        if text is not None:
            log(f"{variant.name}: {text}")

    experiment = run_experiment(repo, overrides, variant.name, log=stage_lines, pythonpath=pythonpath, replace=True)
    try:
        keep = repo / "results" / variant.name
        shutil.rmtree(keep, ignore_errors=True)
        shutil.copytree(experiment.layout.stage_dir("export"), Layout(keep).stage_dir("export"))
        keep_measured_data(experiment.layout.stage_dir("validate"), Layout(keep).stage_dir("validate"))
        for stage, record in (("latency", "decode_cost.json"), ("prune", "plan.json")):  # a causal LM's plan
            if (experiment.layout.stage_dir(stage) / record).is_file():
                shutil.copyfile(experiment.layout.stage_dir(stage) / record, keep / record)
        dump_json(experiment.metrics(), keep / "metrics.json")
        ran = experiment.stages_run()  # each stage that ran recorded how it ended
        dump_json([s for s in STAGE_NAMES if s not in ran], keep / NOT_RUN)
        log(f"{variant.name}: done ({experiment.name}, recorded by dvc exp)")
    finally:
        experiment.remove()
    return keep


def prepare_workload(
    work: Path,
    workload: WorkloadConfig,
    params: dict[str, Any],
    log: Callable[[str], None],
    root: Path,
) -> tuple[dict[str, Path], dict[str, str]]:
    """Runs every variant of a workload; a failing one is reported and the others go on.

    The project root is importable in every run (a workload's model may be given by import path).

    Returns:
        Each finished variant's results directory, and why each failed variant failed.
    """
    prepare_repo(work, params, root)
    dirs: dict[str, Path] = {}
    failed: dict[str, str] = {}
    done: dict[str, dict] = {}

    def tagged(line: str) -> None:
        log(f"[{workload.name}] {line}")

    for variant in workload.variants:
        try:
            reference = reference_to_match(variant, dirs, done, tagged)
            overrides = variant_overrides(variant, done, reference, workload.task)
            dirs[variant.name] = run_variant(work, variant, overrides, tagged, (root,))
        except PruneOpsError as exc:
            failed[variant.name] = str(exc)
            log(f"[{workload.name}] {variant.name}: skipped: {exc}")
            continue
        done[variant.name] = read_json(dirs[variant.name] / "metrics.json")
    return dirs, failed


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
        root: Directory that `work_dir`, `out_dir` and relative data paths are relative to.
        log: Progress sink (one line per finished variant).

    Returns:
        The report; each workload's in `<out_dir>/<workload>/` (`report.md`, `results.json`, plots).
    """
    from pruneops.compare.decoders import measure_decoder_workload, select_decoder, selection_budgets
    from pruneops.compare.report import measure_workload, select_point, write_report

    timing = parse_section("bench.timing", config.timing, BenchmarkConfig)
    rows: dict[str, list[dict]] = {}
    selected: dict[str, dict] = {}
    failed: dict[str, dict[str, str]] = {}
    predictions: dict[str, list[dict]] = {}
    wall: dict[str, dict] = {}
    all_dirs: dict[str, dict[str, Path]] = {}
    for workload in config.workloads:
        started = time.monotonic()
        work = (root / config.work_dir / workload.name).resolve()
        cached_before = sum(1 for f in (work / ".dvc" / "cache" / "runs").rglob("*") if f.is_file())
        with project_importable(root):
            params = workload_params(base_params, workload, root)
        dirs, failed[workload.name] = prepare_workload(work, workload, params, log, root.resolve())
        log(f"[{workload.name}] timing {2 * len(dirs)} models, interleaved")
        if workload.task == "causal_lm":
            rows[workload.name], predictions[workload.name] = measure_decoder_workload(work, workload, dirs, timing)
            pick = select_decoder(rows[workload.name], selection_budgets(workload))
        else:
            rows[workload.name], predictions[workload.name] = measure_workload(work, workload, dirs, timing)
            pick = select_point(rows[workload.name], workload.max_accuracy_drop_points)
        all_dirs[workload.name] = dirs
        if pick is not None:
            selected[workload.name] = pick
        seconds = round(time.monotonic() - started, 1)
        reused = [f"{name}: stage '{stage}' not run" for name, d in dirs.items() for stage in read_json(d / NOT_RUN)]
        wall[workload.name] = {"seconds": seconds, "cached_runs_at_start": cached_before, "reused_stages": reused}
    out = root / config.out_dir
    reports = write_report(config, rows, selected, failed, timing, command, out, predictions, wall=wall, dirs=all_dirs)
    return BenchReport(rows, selected, failed, reports)


def select_runs(
    config: BenchConfig, only: list[str] | None = None, variants: list[str] | None = None, out_dir: str | None = None
) -> BenchConfig:
    """`config` narrowed to some workloads and variants, its report written to `out_dir`.

    A variant kept brings along the dense variants (every row is measured against dense) and the
    variants whose MACs or latency it matches, so a part of a benchmark measures what the whole does.

    Raises:
        ConfigError: A workload or variant name that the benchmark does not define.
    """
    workloads = [w for w in config.workloads if not only or w.name in only]
    unknown = set(only or ()) - {w.name for w in workloads}
    unknown |= set(variants or ()) - {v.name for w in workloads for v in w.variants}
    if unknown:
        raise ConfigError(f"bench: no workload or variant named {', '.join(sorted(unknown))} in the benchmark")
    if variants:
        workloads = [w.model_copy(update={"variants": _variants_needed(w, set(variants))}) for w in workloads]
    return config.model_copy(update={"workloads": workloads, "out_dir": out_dir or config.out_dir})


def _variants_needed(workload: WorkloadConfig, names: set[str]) -> list[VariantConfig]:
    """The named variants of `workload`, its dense ones, and those they match (in the workload's order)."""
    by_name = {v.name: v for v in workload.variants}
    keep = {v.name for v in workload.variants if v.kind == "dense"}
    pending = [n for n in names if n in by_name]
    while pending:
        name = pending.pop()
        if name not in keep:
            keep.add(name)
            pending += [m for m in (by_name[name].match_macs_of, by_name[name].match_latency_of) if m]
    return [v for v in workload.variants if v.name in keep]


def run_bench_file(
    config_path: Path,
    root: Path,
    params_file: str,
    command: str,
    only: list[str] | None = None,
    variants: list[str] | None = None,
    out_dir: str | None = None,
) -> BenchReport:
    """`pruneops bench --config FILE`: reads the benchmark definition and the project's params."""
    try:
        raw = yaml.safe_load(Path(config_path).read_text())
    except yaml.YAMLError as exc:
        raise ConfigError(f"{config_path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    config = select_runs(parse_section("bench", raw, BenchConfig), only, variants, out_dir)
    started = time.monotonic()

    def log(line: str) -> None:  # elapsed minutes: how far a run of an hour or more has got
        minutes, seconds = divmod(int(time.monotonic() - started), 60)
        print(f"pruneops bench [{minutes:3d}:{seconds:02d}]: {line}", flush=True)

    # A bench file whose workloads carry every section they need runs without a project around it.
    base = read_params(root / params_file) if (root / params_file).is_file() else {}
    return run_benchmarks(config, base, command, root, log=log)
