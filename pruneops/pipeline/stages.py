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
from typing import Any

import yaml

from pruneops.config import (
    CORPUS_DATASET,
    EXTRA_SECTIONS,
    BenchmarkConfig,
    ExportConfig,
    FinetuneConfig,
    LatencyConfig,
    PruneConfig,
    QuantizeConfig,
    SensitivityConfig,
    StageConfig,
    TrainConfig,
    ValidateConfig,
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
    decoder_axes: tuple[str, str] | None = None  # (x, y) of the rows a causal LM's stage writes instead


@dataclass(frozen=True)
class Stage:
    """One pipeline stage.

    Args:
        name: The stage (DVC stage, CLI command and params section).
        config: Its params section's config class.
        function: `module:function` called as `function(config, *reads_configs, layout)`.
        help: One line for `pruneops --help`.
        reads: Keys of other sections it depends on, as `section.key` (their sections' configs
            are passed after its own, in order of first appearance).
        upstream: Stages whose outputs (`artifacts/<stage>`) it reads.
        plots: The plot files it writes.
        builds_model: Whether it builds the model architecture (so a user's model module is one
            of its dependencies).
        fans_out: Whether it runs independent evaluations on the `compute` backend (passed as
            `compute=`; not a DVC dependency: where they run does not change the results).
        timed: Whether it times models (latency table, gates, precision choice, benchmark): with
            `compute.timing_resource` it runs whole on the node that resource marks.
    """

    name: str
    config: type[StageConfig]
    function: str
    help: str
    reads: tuple[str, ...] = ()
    upstream: tuple[str, ...] = ()
    plots: tuple[Plot, ...] = ()
    builds_model: bool = False
    fans_out: bool = False
    timed: bool = False

    @property
    def module(self) -> str:
        """The module that implements the stage."""
        return self.function.partition(":")[0]

    @property
    def sections(self) -> tuple[str, ...]:
        """Params sections passed to the stage function: its own, then those of `reads`."""
        extra = [k.partition(".")[0] for k in self.reads]
        return (self.name, *dict.fromkeys(s for s in extra if s != self.name))

    def resolve(self) -> Callable[..., StageReport]:
        """The stage function (imported now: stage modules import torch)."""
        module, _, attr = self.function.partition(":")
        return getattr(importlib.import_module(module), attr)

    def run(self, configs: dict[str, StageConfig], layout: Layout) -> StageReport:
        """Runs the stage with validated configs (all of `sections` must be present)."""
        if self.fans_out:
            compute = configs.get("compute") or SECTIONS["compute"]()
            return self.resolve()(*(configs[s] for s in self.sections), layout, compute=compute)
        return self.resolve()(*(configs[s] for s in self.sections), layout)


# How a causal LM's decode is timed (latency table, prune gate, precision choice).
_DECODE_TIMING = ("benchmark.prompt_length", "benchmark.new_tokens", "benchmark.rounds")

_HISTORY = (Plot("history.json", "epoch", "val_accuracy"), Plot("history.png"))
_RECOVERY = (Plot("history.json", "epoch", "val_accuracy", ("tokens", "loss")), Plot("history.png"))

STAGES: tuple[Stage, ...] = (
    Stage(
        "validate",
        ValidateConfig,
        "pruneops.task.classification.validate:validate_dataset",
        "load, split and check the data (Great Expectations)",
    ),
    Stage(
        "train",
        TrainConfig,
        "pruneops.task.classification.train:train_baseline",
        "train the baseline model",
        upstream=("validate",),
        plots=_HISTORY,
        builds_model=True,
    ),
    Stage(
        "sensitivity",
        SensitivityConfig,
        "pruneops.task.classification.sensitivity:analyze_sensitivity",
        "per-unit sensitivity sweep (each unit pruned alone)",
        reads=("prune.method", "prune.use_sensitivity"),
        upstream=("validate", "train"),
        plots=(
            Plot("curves.json", "ratio", "accuracy_drop", ("layer", "perplexity_increase")),
            Plot("sensitivity.png"),
        ),
        builds_model=True,
        fans_out=True,
    ),
    Stage(
        "latency",
        LatencyConfig,
        "pruneops.task.classification.latency:measure_latency_table",
        "for latency targets: time the units' widths on this machine (the latency table)",
        reads=(
            "prune.target.kind",
            "prune.target.form",
            "benchmark.threads",
            "benchmark.batch_sizes",
            *_DECODE_TIMING,
            "quantize.method",
        ),
        upstream=("validate", "train", "sensitivity"),
        plots=(Plot("latency.png"),),
        builds_model=True,
        timed=True,
    ),
    Stage(
        "prune",
        PruneConfig,
        "pruneops.task.classification.prune:prune_iteratively",
        "plan per-unit widths for the target, gate them on measured latency, prune iteratively",
        reads=("benchmark.threads", "benchmark.batch_sizes", *_DECODE_TIMING),
        upstream=("validate", "train", "sensitivity", "latency"),
        plots=(
            Plot("history.json", "step", "val_accuracy", ("step", "search_perplexity")),
            Plot("history.png"),
            Plot("allocation.png"),
        ),
        builds_model=True,
        fans_out=True,
        timed=True,
    ),
    Stage(
        "finetune",
        FinetuneConfig,
        "pruneops.task.classification.finetune:finetune",
        "recovery fine-tuning with distillation",
        upstream=("validate", "train", "prune"),
        plots=_RECOVERY,
        builds_model=True,
    ),
    Stage(
        "quantize",
        QuantizeConfig,
        "pruneops.task.classification.quantize:quantize_model",
        "ONNX Runtime INT8 quantization (fp32 kept unless INT8 is faster at batch 1 and no slower elsewhere)",
        reads=(
            "benchmark.batch_sizes",
            *_DECODE_TIMING,
            "prune.target.kind",
            "prune.target.form",
            "prune.target.metric",
        ),
        upstream=("validate", "prune", "finetune"),
        builds_model=True,
        timed=True,
    ),
    Stage(
        "export",
        ExportConfig,
        "pruneops.task.classification.export:export_onnx",
        "ONNX export with parity checks (and TensorRT where present)",
        upstream=("validate", "train", "finetune", "quantize"),
        builds_model=True,
    ),
    Stage(
        "benchmark",
        BenchmarkConfig,
        "pruneops.task.classification.benchmark:benchmark_model",
        "latency/throughput/size/accuracy benchmark",
        upstream=("validate", "export"),
        plots=(
            Plot("frontier.json", "latency_b1_ms", "test_accuracy", ("latency_b1_ms", "test_perplexity")),
            Plot("frontier.png"),
        ),
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
    _check_causal_lm(configs)
    return configs


def _check_causal_lm(configs: dict[str, StageConfig]) -> None:
    """A causal LM reads a corpus and is planned on decode time; a classifier reads samples."""
    train, validate = configs.get("train"), configs.get("validate")
    if train is None or validate is None:
        return
    if (train.task == "causal_lm") != (validate.dataset == CORPUS_DATASET):
        raise ConfigError(
            f"train.task: {train.task} with validate.dataset {validate.dataset}: a causal LM reads a corpus "
            "(dataset: corpus) and only a causal LM does"
        )
    prune, quantize, finetune = configs.get("prune"), configs.get("quantize"), configs.get("finetune")
    if train.task != "causal_lm":
        if prune is not None and prune.target is not None and prune.target.metric is not None:
            raise ConfigError("prune.target.metric: applies to a causal LM only (decode or prefill time); remove it")
        if finetune is not None and finetune.compute_dtype != "fp32":
            raise ConfigError("finetune.compute_dtype: applies to a causal LM's recovery only; remove it")
        if finetune is not None and finetune.lora_rank is not None:
            raise ConfigError("finetune.lora_rank: applies to a causal LM's recovery only; remove it")
        return
    if prune is not None and (prune.target is None or not prune.target.is_latency or prune.target.batch != 1):
        raise ConfigError(
            "prune.target: a causal LM is planned on its measured time at batch 1 (per output token, or to the "
            "first token with metric: prefill): kind latency_ratio or latency_ms, batch 1"
        )
    if prune is not None and prune.target.form != "fp32":
        raise ConfigError(
            "prune.target.form: a causal LM is planned in fp32; quantize then picks its precision by perplexity"
        )
    if quantize is not None and quantize.method != "auto":
        raise ConfigError(
            "quantize.method: a causal LM's precision is chosen among fp32 and quantize.decoder_precisions "
            "(onnxruntime-genai weight-only): auto"
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
    wanted = get_stage(stage).sections
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
