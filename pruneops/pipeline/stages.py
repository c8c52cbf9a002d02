"""The stage table: every pipeline stage declared once.

The CLI, the Prefect tasks, `bench`, params loading, `dvc.yaml` (written by `pruneops dvc-yaml`)
and the tests all read `STAGES`. Adding a stage or a params section means adding one `Stage`
here (and its config class in `pruneops.config`); its module goes in this package.
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, get_args

import yaml

from pruneops.config import (
    CORPUS_DATASET,
    EXTRA_SECTIONS,
    TASK_NOUNS,
    BenchmarkConfig,
    ExportConfig,
    FinetuneConfig,
    LatencyConfig,
    PruneConfig,
    QuantizeConfig,
    SensitivityConfig,
    StageConfig,
    Task,
    TrainConfig,
    ValidateConfig,
    keys_of_other_task,
    with_task_defaults,
)
from pruneops.core.errors import ConfigError
from pruneops.core.io import Layout
from pruneops.core.params import parse_section, read_params


class StageReport:
    """Base of every stage's report (a frozen dataclass).

    `metrics()` is what `dvc metrics` tracks: every field that is not a path. `summary()` is the
    one line the CLI prints. `warnings` (when a report has it) lists what the stage could not do
    as configured and did otherwise; the CLI prints each one.
    """

    def metrics(self) -> dict[str, Any]:
        """The figures tracked by `dvc metrics` (every non-path field)."""
        out = {}
        for f in dataclasses.fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if not isinstance(value, Path):
                out[f.name] = list(value) if isinstance(value, tuple) else value
        return out

    def summary(self) -> str:
        """One line for the terminal."""
        raise NotImplementedError

    @property
    def warning_lines(self) -> tuple[str, ...]:
        """What the stage recorded as not done as configured."""
        return tuple(getattr(self, "warnings", ()))


@dataclass(frozen=True)
class Plot:
    """A plot file a stage writes under `plots/<stage>/` (JSON ones name their axes for `dvc plots`)."""

    file: str
    x: str | None = None
    y: str | None = None


@dataclass(frozen=True)
class UserFile:
    """A file the user's params name that a stage reads: the params key, and whether its folder is what counts.

    `folder`: the file's parent folder is the dependency (an onnxruntime-genai `model.onnx` is read
    with its weights and config beside it).
    """

    key: str
    folder: bool = False


@dataclass(frozen=True)
class Impl:
    """One task's implementation of a stage.

    Args:
        function: `module:function` called as `function(config, *reads_configs, layout)`.
        reads: Keys of other sections it depends on, as `section.key` (their sections' configs are
            passed after its own, in order of first appearance).
        files: The user files its params name (each a DVC dependency of the stage).
        plots: The plot files it writes.
        builds_model: Whether it builds the model architecture (a user's model module given as
            `package.module:factory` is then one of its dependencies).
        fans_out: Whether it runs independent evaluations on the `compute` backend (passed as
            `compute=`; not a DVC dependency: where they run does not change the results).
        passes_on: Keys of its own section that a later stage reads and it does not, as
            `block.key` (`gate.max_perplexity_increase`): its dependency on that block narrows to
            the block's other keys, so a change to one of them reruns the stage that reads it alone.
    """

    function: str
    reads: tuple[str, ...] = ()
    files: tuple[UserFile, ...] = ()
    plots: tuple[Plot, ...] = ()
    builds_model: bool = False
    fans_out: bool = False
    passes_on: tuple[str, ...] = ()

    @property
    def module(self) -> str:
        """The module that implements it."""
        return self.function.partition(":")[0]

    def resolve(self) -> Callable[..., StageReport]:
        """The function (imported now: stage modules import torch)."""
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its params section, its place in the pipeline, one implementation per task.

    Args:
        name: The stage (DVC stage, CLI command and params section).
        config: Its params section's config class.
        help: One line for `pruneops --help`.
        impls: Each task's implementation (`train.task` picks one for the whole run).
        upstream: Stages whose outputs (`artifacts/<stage>`) it reads.
        timed: Whether it times models (latency table, gates, precision choice, benchmark): with
            `compute.timing_resource` it runs whole on the node that resource marks.
    """

    name: str
    config: type[StageConfig]
    help: str
    impls: dict[Task, Impl]
    upstream: tuple[str, ...] = ()
    timed: bool = False

    def impl(self, task: Task) -> Impl:
        """The implementation for `task`."""
        return self.impls[task]

    @property
    def modules(self) -> tuple[str, ...]:
        """Every task's implementing module."""
        return tuple(i.module for i in self.impls.values())

    def sections(self, task: Task) -> tuple[str, ...]:
        """Params sections passed to `task`'s function: its own, then those of its `reads`."""
        extra = [k.partition(".")[0] for k in self.impl(task).reads]
        return (self.name, *dict.fromkeys(s for s in extra if s != self.name))

    def run(self, configs: dict[str, StageConfig], layout: Layout) -> StageReport:
        """Runs the task's implementation with validated configs (all of its `sections` must be present)."""
        task = task_of(configs)
        impl = self.impl(task)
        args = [configs[s] for s in self.sections(task)]
        if impl.fans_out:
            return impl.resolve()(*args, layout, compute=configs.get("compute") or SECTIONS["compute"]())
        return impl.resolve()(*args, layout)


def task_of(configs: dict[str, StageConfig]) -> Task:
    """The run's task (`train.task`; a classifier where the params have no `train` section)."""
    train = configs.get("train")
    return train.task if train is not None else "classification"


# How a causal LM's decode is timed (latency table, prune gate, precision choice).
_DECODE_TIMING = ("benchmark.threads", "benchmark.prompt_length", "benchmark.new_tokens", "benchmark.rounds")
_CLS = "pruneops.task.classification"
_LM = "pruneops.task.causal_lm"
_HISTORY = (Plot("history.json", "epoch", "val_accuracy"), Plot("history.png"))
# `prune.gate`'s quality budgets are judged by `quantize` (on the model as recovered), its speed floor
# by `prune`: a changed budget reruns quantize onwards, never the plan search or the recovery.
_BUDGETS: dict[Task, tuple[str, ...]] = {
    "classification": ("gate.max_accuracy_drop",),
    "causal_lm": ("gate.max_perplexity_increase", "gate.max_general_perplexity_increase", "gate.max_zero_shot_drop"),
}

STAGES: tuple[Stage, ...] = (
    Stage(
        "validate",
        ValidateConfig,
        "load, split and check the data (Great Expectations)",
        {
            "classification": Impl(
                f"{_CLS}.validate:validate_dataset", files=(UserFile("validate.path"), UserFile("validate.tokenizer"))
            ),
            "causal_lm": Impl(
                f"{_LM}.validate:validate_corpus",
                files=(
                    UserFile("validate.path"),
                    UserFile("validate.tokenizer"),
                    UserFile("validate.general_text"),
                    UserFile("validate.zero_shot"),
                ),
            ),
        },
    ),
    Stage(
        "train",
        TrainConfig,
        "train the baseline model",
        {
            "classification": Impl(
                f"{_CLS}.train:train_baseline",
                files=(UserFile("train.init_weights"), UserFile("train.pretrained")),
                plots=_HISTORY,
                builds_model=True,
            ),
            "causal_lm": Impl(
                f"{_LM}.train:adopt_causal_lm",
                reads=("export.runtime",),
                files=(UserFile("train.pretrained"),),
                plots=_HISTORY,
            ),
        },
        upstream=("validate",),
    ),
    Stage(
        "sensitivity",
        SensitivityConfig,
        "per-unit sensitivity sweep (each unit pruned alone)",
        {
            "classification": Impl(
                f"{_CLS}.sensitivity:analyze_sensitivity",
                reads=("prune.method", "prune.use_sensitivity"),
                plots=(Plot("curves.json", "ratio", "accuracy_drop"), Plot("sensitivity.png")),
                builds_model=True,
                fans_out=True,
            ),
            "causal_lm": Impl(
                f"{_LM}.sensitivity:layer_sensitivity",
                plots=(Plot("curves.json", "layer", "perplexity_increase"), Plot("sensitivity.png")),
                fans_out=True,
            ),
        },
        upstream=("validate", "train"),
    ),
    Stage(
        "latency",
        LatencyConfig,
        "for latency targets: time the units' widths on this machine (the latency table)",
        {
            "classification": Impl(
                f"{_CLS}.latency:measure_latency_table",
                reads=(
                    "prune.target.kind",
                    "prune.target.form",
                    "benchmark.threads",
                    "benchmark.batch_sizes",
                    "quantize.method",
                ),
                plots=(Plot("latency.png"),),
                builds_model=True,
            ),
            "causal_lm": Impl(f"{_LM}.latency:decode_cost_table", reads=_DECODE_TIMING, plots=(Plot("latency.png"),)),
        },
        upstream=("validate", "train", "sensitivity"),
        timed=True,
    ),
    Stage(
        "prune",
        PruneConfig,
        "plan per-unit widths for the target, gate them on measured latency, prune iteratively",
        {
            "classification": Impl(
                f"{_CLS}.prune:prune_iteratively",
                reads=("benchmark.threads", "benchmark.batch_sizes"),
                files=(UserFile("prune.target.reference"),),
                passes_on=_BUDGETS["classification"],
                plots=(
                    Plot("history.json", "step", "val_accuracy"),
                    Plot("history.png"),
                    Plot("allocation.png"),
                ),
                builds_model=True,
                fans_out=True,
            ),
            "causal_lm": Impl(
                f"{_LM}.prune:prune_decoder",
                reads=_DECODE_TIMING,
                files=(UserFile("prune.target.reference", folder=True),),
                passes_on=_BUDGETS["causal_lm"],
                plots=(
                    Plot("history.json", "step", "search_perplexity"),
                    Plot("history.png"),
                    Plot("allocation.png"),
                ),
            ),
        },
        upstream=("validate", "train", "sensitivity", "latency"),
        timed=True,
    ),
    Stage(
        "finetune",
        FinetuneConfig,
        "recovery fine-tuning with distillation",
        {
            "classification": Impl(f"{_CLS}.finetune:finetune", plots=_HISTORY, builds_model=True),
            "causal_lm": Impl(
                f"{_LM}.finetune:recover_decoder", plots=(Plot("history.json", "tokens", "loss"), Plot("history.png"))
            ),
        },
        upstream=("validate", "train", "prune"),
    ),
    Stage(
        "quantize",
        QuantizeConfig,
        "INT8 (or another precision) where it measures faster within tolerance, fp32 otherwise",
        {
            "classification": Impl(
                f"{_CLS}.quantize:quantize_model",
                reads=(
                    "benchmark.batch_sizes",
                    "prune.target.kind",
                    "prune.target.form",
                    *(f"prune.{key}" for key in _BUDGETS["classification"]),
                ),
                builds_model=True,
            ),
            "causal_lm": Impl(
                f"{_LM}.quantize:quantize_stage",
                reads=(*_DECODE_TIMING, "prune.target.metric", *(f"prune.{key}" for key in _BUDGETS["causal_lm"])),
            ),
        },
        upstream=("validate", "prune", "finetune"),
        timed=True,
    ),
    Stage(
        "export",
        ExportConfig,
        "the serving artefacts with parity checks (and TensorRT where present)",
        {
            "classification": Impl(f"{_CLS}.export:export_onnx", builds_model=True),
            "causal_lm": Impl(f"{_LM}.export:export_decoder"),
        },
        upstream=("validate", "train", "finetune", "quantize"),
    ),
    Stage(
        "benchmark",
        BenchmarkConfig,
        "latency/throughput/size/accuracy benchmark",
        {
            "classification": Impl(
                f"{_CLS}.benchmark:benchmark_model",
                plots=(Plot("frontier.json", "latency_b1_ms", "test_accuracy"), Plot("frontier.png")),
            ),
            "causal_lm": Impl(
                f"{_LM}.benchmark:benchmark_decoder",
                plots=(Plot("frontier.json", "latency_b1_ms", "test_perplexity"), Plot("frontier.png")),
            ),
        },
        upstream=("validate", "export"),
        timed=True,
    ),
)

STAGE_NAMES: tuple[str, ...] = tuple(s.name for s in STAGES)

# Every params section: one per stage, then the orchestration sections.
SECTIONS: dict[str, type[StageConfig]] = {**{s.name: s.config for s in STAGES}, **EXTRA_SECTIONS}


def get_stage(name: str) -> Stage:
    """The stage called `name`.

    Raises:
        ConfigError: No such stage.
    """
    for stage in STAGES:
        if stage.name == name:
            return stage
    raise ConfigError(f"unknown stage {name!r}; stages: {', '.join(STAGE_NAMES)}")


def check_sections(params: dict[str, Any]) -> None:
    """Rejects top-level sections that name nothing (a typo would otherwise be ignored)."""
    unknown = sorted(set(params) - set(SECTIONS))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section; sections are: {', '.join(SECTIONS)}")


def load_configs(params: dict[str, Any], sections: tuple[str, ...] | None = None) -> dict[str, StageConfig]:
    """Validates params sections into their configs.

    Args:
        params: The params mapping (e.g. from `read_params`).
        sections: Which sections to validate and return; default every stage section present
            plus the orchestration sections. A requested stage section must be in `params`: a
            missing one would run on built-in defaults nobody chose.

    Raises:
        ConfigError: One line naming the first bad key (exit code 2).
    """
    check_sections(params)
    wanted = sections if sections is not None else tuple(s for s in SECTIONS if s in params)
    configs = {}
    for name in wanted:
        if name not in SECTIONS:
            raise ConfigError(f"{name}: unknown section; sections are: {', '.join(SECTIONS)}")
        if name in STAGE_NAMES and name not in params:
            raise ConfigError(
                f"{name}: section missing from the params file (every stage needs its own){_defaults_hint(name)}"
            )
        if name in params and params[name] is None:  # `train:` with nothing under it
            raise ConfigError(
                f"{name}: the section is empty (a key lost its indentation?); write its keys{_defaults_hint(name)}"
            )
        configs[name] = parse_section(name, params.get(name), SECTIONS[name])
    _check_target_batch(configs)
    task = _task_in(params, configs)
    _check_task(configs, task)
    return {name: with_task_defaults(config, task) for name, config in configs.items()} if task else configs


def _task_in(params: dict[str, Any], configs: dict[str, StageConfig]) -> Task | None:
    """The params' task: `train.task`, read from the file even when its section was not asked for.

    Read as it is written, not by validating the section (which imports the model registry): a
    value that is not a task is refused where the `train` section is loaded. None: the file has
    no `train` section (a file of orchestration sections alone names no task).
    """
    if "train" in configs:
        return task_of(configs)
    if not isinstance(params.get("train"), dict):
        return None
    task = params["train"].get("task", "classification")
    return task if task in get_args(Task) else "classification"


def _check_task(configs: dict[str, StageConfig], task: Task | None) -> None:
    """Every section holds the keys of the run's task only; a causal LM reads a corpus, planned on its time.

    The task is `train.task`: a key of the other task set in the file would be ignored, so it is
    refused, naming it.
    """
    if task is None:
        return
    for name, config in configs.items():
        for key, other in keys_of_other_task(config, task, name):
            raise ConfigError(f"{key}: applies to {TASK_NOUNS[other]} only (train.task is {task}); remove it")
    train, validate = configs.get("train"), configs.get("validate")
    if train is not None and validate is not None and (task == "causal_lm") != (validate.dataset == CORPUS_DATASET):
        raise ConfigError(
            f"train.task: {train.task} with validate.dataset {validate.dataset}: a causal LM reads a corpus "
            "(dataset: corpus) and only a causal LM does"
        )
    target = configs["prune"].target if "prune" in configs else None
    planned_on_time = "prune" not in configs or (target is not None and target.is_latency and target.batch == 1)
    if task == "causal_lm" and not planned_on_time:
        raise ConfigError(
            "prune.target: a causal LM is planned on its measured time at batch 1 (per output token, or to the "
            "first token with metric: prefill): kind latency_ratio or latency_ms, batch 1"
        )


def _defaults_hint(name: str) -> str:
    """Where a missing section is short (a project from before its stage existed, say), its defaults to paste."""
    defaults = SECTIONS[name]().model_dump(mode="json")
    flow = f"{name}: " + yaml.safe_dump(defaults, default_flow_style=True, sort_keys=False, width=10**6).strip()
    return f"; its defaults are `{flow}`" if len(flow) <= 100 else ""


def _check_target_batch(configs: dict[str, StageConfig]) -> None:
    """A latency target's batch must be one the latency table is measured at (1 and the benchmark's).

    So the latency stage (the table) does not depend on `prune.target.batch`: moving a target
    between measured batches reuses the sweep instead of rerunning it.
    """
    prune, benchmark = configs.get("prune"), configs.get("benchmark")
    if prune is None or benchmark is None or prune.target is None or prune.target.batch is None:
        return
    measured = sorted({1, *benchmark.batch_sizes})
    if prune.target.batch not in measured:
        raise ConfigError(
            f"prune.target.batch: {prune.target.batch} is not a batch the latency table is measured at "
            f"({measured}: 1 and benchmark.batch_sizes); add it to benchmark.batch_sizes"
        )


def load_section(project: str | Path, name: str, params_file: str = "params.yaml") -> StageConfig:
    """One validated section of a project's params (e.g. `reprune` for the flows)."""
    return load_configs(read_params(Path(project) / params_file), (name,))[name]


def load_stage_configs(params_path: str | Path, stage: str) -> dict[str, StageConfig]:
    """Reads a params file and validates every section in it, and those `stage` needs.

    Every section is checked whichever stage runs: a bad value anywhere stops the first stage,
    not one an hour later.
    """
    params = read_params(params_path)
    stage_ = get_stage(stage)
    wanted = {s for impl in stage_.impls.values() for s in (stage_.name, *(k.partition(".")[0] for k in impl.reads))}
    return load_configs(params, tuple(s for s in SECTIONS if s in params or s in wanted))


@contextmanager
def project_importable(*roots: str | Path) -> Iterator[None]:
    """Puts the project (and any further roots) first on `sys.path`, where a model module may live."""
    entries = [str(Path(root).resolve()) for root in roots]
    sys.path[:0] = entries
    try:
        yield
    finally:
        for entry in entries:
            if entry in sys.path:
                sys.path.remove(entry)
