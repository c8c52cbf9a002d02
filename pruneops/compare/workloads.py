"""A bench file's schema: workloads, each a dataset and model with variants run as DVC experiments."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# What every classifier variant adds: its own `benchmark` stage only has to work (bench times all
# together). A causal LM's `benchmark.rounds` also times its plans and precisions: left as set.
QUICK_BENCHMARK = {"benchmark.warmup": 2, "benchmark.repeats": 10, "benchmark.rounds": 1}

# A dense variant runs the same stages with nothing pruned, nothing swept and nothing trained.
DENSE = {
    "prune.target.kind": "ratio",
    "prune.target.value": 0.0,
    "prune.target.batch": None,
    "prune.gate.min_speedup": None,
    "prune.use_sensitivity": False,
    # One step: with nothing pruned and nothing trained, every further step is one more
    # evaluation of the same model on val (~10 s each at 64x64).
    "prune.schedule": "oneshot",
    "prune.steps": 1,
    "prune.epochs_per_step": 0,
    "finetune.epochs": 0,
}
# A causal LM's dense variant: nothing cut, nothing recovered; quantize still chooses its precision.
DENSE_CAUSAL_LM = {"prune.decoder.strategy": "none", "finetune.max_tokens": 0}


def quick_overrides(task: str) -> dict[str, Any]:
    """What every variant of a `task` workload adds."""
    return QUICK_BENCHMARK if task == "classification" else {}


def dense_overrides(task: str) -> dict[str, Any]:
    """What makes a variant of a `task` workload the dense model."""
    return DENSE if task == "classification" else DENSE_CAUSAL_LM


class VariantConfig(BaseModel):
    """One recipe: dotted params overrides on top of the workload's params.

    `match_macs_of` names an earlier variant: this one prunes to that variant's MACs
    (`prune.target.kind: macs`), for a comparison at the same compute budget. `match_latency_of`
    likewise prunes to that variant's batch-1 latency: a comparison at the same milliseconds, in
    this variant's `prune.target.form` if it sets one, else in the form the other variant's prune
    stage timed. Where the other variant's export in that form exists (its fp32 export, or its
    deployed one if deployed in that INT8 form), it is the prune stage's `target_reference` at a
    ratio of 1.0: every gate reading times it beside dense and the plan (`reference_to_match`).
    Otherwise the target is the ratio to dense the other variant's prune stage measured, which
    must then be in the same form.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    kind: Literal["dense", "pruned"] = "pruned"
    family: Literal["dense", "naive", "torch_pruning", "shortgpt", "ours"] = "ours"
    label: str = ""
    set: dict[str, Any] = Field(default_factory=dict)
    match_macs_of: str | None = None
    match_latency_of: str | None = None


class WorkloadConfig(BaseModel):
    """A model on a dataset, its params (nested sections) and the variants to compare."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    name: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")]
    params: dict[str, dict[str, Any]] = Field(default_factory=dict)
    # The budget a selected point holds on validation, at the far end of its 95 % paired interval:
    # accuracy points (classifiers) or relative perplexity (causal LMs).
    max_accuracy_drop_points: Annotated[float, Field(ge=0)] = 0.3
    max_perplexity_increase: Annotated[float, Field(ge=0)] = 0.10
    # A causal LM's budgets beyond the corpus, held on the gating halves as its quantize stage measured them
    # (general text, relative perplexity; the zero-shot check, accuracy points); null: not held. As
    # `prune.gate`'s defaults, so the selected row is one the pipeline would ship under them.
    max_general_perplexity_increase: Annotated[float, Field(ge=0)] | None = 0.15
    max_zero_shot_drop: Annotated[float, Field(ge=0)] | None = 3.0
    # What the selected point must reach: speedup_b1, throughput_gain (largest batch), size_reduction,
    # speedup_b1_vs_dense_deployed (against the dense model quantised as the pipeline deploys it).
    targets: dict[Literal["speedup_b1", "throughput_gain", "size_reduction", "speedup_b1_vs_dense_deployed"], float] = (
        Field(default_factory=dict)
    )
    variants: list[VariantConfig]

    @property
    def task(self) -> str:
        """`train.task` of its params (a classifier unless they say otherwise)."""
        return self.params.get("train", {}).get("task", "classification")


class BenchConfig(BaseModel):
    """The whole benchmark: where to work, how to time, which workloads."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    work_dir: str = "state/bench"
    # Each workload's report goes to `<out_dir>/<workload>/`; `pruneops reference` indexes every
    # report under docs/results into docs/results.md.
    out_dir: str = "docs/results"
    timing: dict[str, Any] = Field(default_factory=dict)
    recipes: dict[str, dict[str, Any]] = Field(default_factory=dict)  # YAML anchors shared by variants
    workloads: list[WorkloadConfig]
