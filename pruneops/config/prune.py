"""The `prune` section, nested by concern: what to reach, the gate, plan trials, distillation."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pruneops.config.base import (
    BatchSize,
    LearningRate,
    Ratio,
    Seed,
    StageConfig,
    Text,
    Threads,
    lookup,
    registered,
    task_keys,
)
from pruneops.core.quality import QualityBudget

LATENCY_TARGETS = ("latency_ms", "latency_ratio")

# `prune.target.form: auto`: plan in every form the quantize stage may ship, keep the cheapest plan.
AUTO_FORM = "auto"


# A ratio of a reference model's latency may exceed 1 (slower than the reference, faster than dense),
# but a plan is never slower than dense: past this the target is not a pruning target.
MAX_REFERENCE_RATIO = 4.0

DEFAULT_PLAN_TRIALS = 4  # plans trained briefly per latency allocation: the best uniform cut and three others


TargetKind = Literal["ratio", "macs", "params", "latency_ms", "latency_ratio"]

# What a causal LM's latency target is a ratio of: time per output token at steady decode, or time to
# first token (prefill of `benchmark.prompt_length` tokens).
DecoderMetric = Literal["decode", "prefill"]


class TargetConfig(StageConfig):
    """`prune.target`: what the pruned model must reach, and in which form it is timed.

    `kind`: `ratio` (fraction of channels/heads, MAC-weighted, or of weights to remove), `macs` or
    `params` (the most one sample's forward pass may cost, or the model may hold), `latency_ms` or
    `latency_ratio` (predicted latency at `batch` on this machine, in milliseconds or as a fraction
    of dense; structured methods). `value`: how much. `batch` (latency kinds only; 1 when not set):
    the batch size the latency is at. `reference` (with `latency_ratio`): an ONNX file (relative to
    the project) whose latency the ratio is of instead of dense's: 1.0 asks to be as fast as that
    model (one served now, or another pruning tool's result), which the gate times interleaved with
    dense and each plan, so that the comparison holds in whatever state the machine is in. It is
    timed as it is (not quantized); its inputs must be named as the model's export names them. For
    a causal LM it is the `model.onnx` of an onnxruntime-genai folder (the whole folder is the DVC
    dependency), timed with dense in the target's `metric`.
    `form`: the form that latency, and the gate's, is measured in: `fp32`, or a quantizer's name
    (`static`, `dynamic`) when that is what will be deployed: INT8 and fp32 do not rank plans alike
    (INT8 kernels have their own fast channel counts and per-operator costs). `auto` plans in every
    form the quantize stage may ship (each `quantize.method: auto` candidate, or the one method
    named) and keeps the plan that meets the target with the least predicted accuracy loss; a
    `latency_ratio` is then of dense fp32, so an INT8 form needs fewer cuts. `metric` (causal LMs
    only): `decode` (time per output token, the default) or `prefill` (time to first token after a
    `benchmark.prompt_length`-token prompt); plans, the gate and the precision choice go by it.
    """

    TASK_KEYS = task_keys(
        classification="form",
        causal_lm="metric",
    )

    kind: TargetKind
    value: Annotated[float, Field(ge=0.0, le=1e18)]
    batch: Annotated[int, Field(ge=1, le=4096)] | None = None
    reference: Text | None = None
    form: str = "fp32"
    metric: DecoderMetric | None = None

    @property
    def decoder_metric(self) -> DecoderMetric:
        """What a causal LM's latency ratio is of (`decode` when `metric` is not set)."""
        return self.metric or "decode"

    @model_validator(mode="before")
    @classmethod
    def _latency_batch_defaults_to_one(cls, data: Any) -> Any:
        if isinstance(data, dict) and data.get("kind") in LATENCY_TARGETS and "batch" not in data:
            return {**data, "batch": 1}
        return data

    @field_validator("form")
    @classmethod
    def _known_form(cls, v: str) -> str:
        if v == AUTO_FORM:
            return v
        try:
            return registered("pruneops.runtimes.onnxruntime.quantizers:QUANTIZERS", v)
        except ValueError as exc:
            raise ValueError(f"{exc}; or {AUTO_FORM} (plan in every form the quantize stage may ship)") from None

    @model_validator(mode="after")
    def _value_fits_kind(self) -> TargetConfig:
        value, latency = self.value, self.kind in LATENCY_TARGETS
        if self.reference is not None:
            self._check_reference()
        elif self.kind in ("ratio", "latency_ratio") and not value < 1.0:
            raise ValueError(f"value: a ratio must be less than 1 (got {value})")
        if self.kind == "latency_ratio" and not value > 0.0:
            raise ValueError(f"value: a latency ratio must be more than 0 (got {value})")
        if latency and self.batch is None:
            raise ValueError(f"batch: required by kind {self.kind!r} (the batch size the latency is at)")
        if not latency and self.batch is not None:
            raise ValueError(f"batch: applies to latency kinds only (kind is {self.kind!r}); remove it")
        return self

    def _check_reference(self) -> None:
        if self.kind != "latency_ratio":
            raise ValueError(f"reference: applies to kind latency_ratio only (kind is {self.kind!r})")
        if not self.reference.endswith(".onnx"):
            raise ValueError(f"reference: an ONNX model file (.onnx), not {self.reference!r}")
        if not 0.0 < self.value <= MAX_REFERENCE_RATIO:
            raise ValueError(
                f"value: a ratio of the reference's latency must be in (0, {MAX_REFERENCE_RATIO:g}] (got {self.value})"
            )

    @property
    def is_latency(self) -> bool:
        """Whether the target is a latency (`latency_ms` or `latency_ratio`)."""
        return self.kind in LATENCY_TARGETS

    @property
    def reference_file(self) -> Path | None:
        """`reference` as a path (None without one)."""
        return Path(self.reference) if self.reference else None


class GateConfig(StageConfig):
    """`prune.gate`: what a pruned model must measure against dense, in speed and in quality, to ship.

    `min_speedup`: the plan must measure at least this much faster than dense at batch 1, and not
    slower at the benchmark's largest batch (null: measured and reported, not gated). The quality
    budget, against dense fp32 on validation and judged at the far end of its 95 % paired
    interval: `max_accuracy_drop` accuracy points (classifiers), `max_perplexity_increase` relative
    perplexity (causal LMs); null: measured and reported, not gated. A causal LM with
    `validate.general_text` is also held to `max_general_perplexity_increase` on the general text's
    validation half: a model fitted to the user's corpus that forgets text beyond it does not ship;
    with `validate.zero_shot`, to `max_zero_shot_drop` accuracy points on its check's gating half.
    Both gates back off the same way: a plan that misses the speed floor, or a model whose every
    form misses the budget, ships nothing pruned (dense passes on, in the fastest form within the
    budget), and the report and the stage's warnings give the figures; so does a model whose
    fastest form within the budgets is no faster than dense's fastest form within them (timed in
    the same session).
    """

    TASK_KEYS = task_keys(
        classification="max_accuracy_drop",
        causal_lm="max_perplexity_increase max_general_perplexity_increase max_zero_shot_drop",
    )

    min_speedup: Annotated[float, Field(ge=1.0, le=100.0)] | None = 1.05
    max_accuracy_drop: Annotated[float, Field(ge=0.0, le=100.0)] | None = 1.0
    max_perplexity_increase: Annotated[float, Field(ge=0.0, le=100.0)] | None = 0.10
    max_general_perplexity_increase: Annotated[float, Field(ge=0.0, le=100.0)] | None = 0.15
    max_zero_shot_drop: Annotated[float, Field(ge=0.0, le=100.0)] | None = 3.0

    def budget(self, task: str) -> QualityBudget:
        """The quality budget of `task`'s models."""
        if task == "causal_lm":
            return QualityBudget(self.max_perplexity_increase, "perplexity")
        return QualityBudget(self.max_accuracy_drop, "points")

    def general_budget(self) -> QualityBudget:
        """A causal LM's budget on general text beyond its corpus (`validate.general_text`)."""
        return QualityBudget(self.max_general_perplexity_increase, "perplexity")

    def zero_shot_budget(self) -> QualityBudget:
        """A causal LM's budget on its zero-shot check (`validate.zero_shot`), in accuracy points."""
        return QualityBudget(self.max_zero_shot_drop, "points")


class TrialsConfig(StageConfig):
    """`prune.trials` (latency targets): plans of the allocation trained briefly, the best kept.

    `count` feasible plans (least summed isolated drop first, the best uniform cut among them) are
    each pruned into a copy, BatchNorm-recalibrated and trained one pass over `samples` training
    samples; the best on validation replaces the allocation's own plan where it is better by more
    than two paired standard errors (NetAdapt's short-term fine-tuning,
    `pruneops.planning.trials.PlanTrials`); at deep cuts the sweep's isolated drops rank plans
    against what fine-tuning recovers. 1: no trials; null: 4 for latency targets.
    """

    count: Annotated[int, Field(ge=1, le=64)] | None = None
    samples: Annotated[int, Field(ge=1, le=10_000_000)] = 3200


class DistillationConfig(StageConfig):
    """`prune.distillation`: each step's fine-tuning distils from the unpruned model (0: labels only).

    `weight` of the softened-logit loss at `temperature`; `hidden_weight` times the mean squared
    error between each pruned block's output and the unpruned one's (transformer layers; the hidden
    width must be kept).
    """

    weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 4.0
    hidden_weight: Annotated[float, Field(ge=0.0, le=1000.0)] = 0.0

    @property
    def active(self) -> bool:
        """Whether any distillation loss is on."""
        return self.weight > 0 or self.hidden_weight > 0


# Keys of the flat `prune` section before it was nested by concern, and where each lives now.
MOVED_PRUNE_KEYS = {
    "target_value": "target.value",
    "target_batch": "target.batch",
    "target_reference": "target.reference",
    "latency_form": "target.form",
    "min_speedup": "gate.min_speedup",
    "plan_trials": "trials.count",
    "trial_samples": "trials.samples",
    "distill_weight": "distillation.weight",
    "distill_temperature": "distillation.temperature",
    "hidden_distill_weight": "distillation.hidden_weight",
}


class DecoderCutConfig(StageConfig):
    """`prune.decoder`: how a causal LM is cut to a uniform shape (depth, KV groups, MLP width).

    The plans a decode cost model predicts to meet the target (at most `max_unit_ratio` of the
    layers dropped, depths in multiples of `depth_step`, the KV-group counts in `kv_groups`, all
    when null) are each cut by `importance` with least-squares reconstruction (`reconstruct`)
    from one calibration pass over `calibration_blocks` training blocks (of which the share
    `calibration_self_fraction` the dense model writes itself after each block's first tokens:
    text beyond the corpus, so the cut keeps more of what the model does beyond it), scored on
    `search_blocks` validation blocks, and the lowest perplexity is kept; whole layers go in the
    order the sensitivity stage measured (least perplexity added first).

    `strategy` chooses the plans: `plan` (the above), or a baseline measured the same way:
    `uniform_width` (every layer kept, the MLPs cut to the widest width predicted to meet the
    target, by weight magnitude with no data and no reconstruction: Torch-Pruning's uniform-width
    recipe), `depth` (whole layers removed, lowest block influence first, widths kept: ShortGPT),
    or `none` (nothing cut: dense passes on, what a benchmark's dense row runs).
    """

    strategy: Literal["plan", "uniform_width", "depth", "none"] = "plan"
    importance: str = "activation"
    reconstruct: bool = True
    depth_step: Annotated[int, Field(ge=1, le=1000)] = 2
    kv_groups: Annotated[list[Annotated[int, Field(ge=1, le=1024)]], Field(min_length=1)] | None = None
    calibration_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    calibration_self_fraction: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    search_blocks: Annotated[int, Field(ge=1, le=100_000)] = 8

    @field_validator("importance")
    @classmethod
    def _known_importance(cls, v: str) -> str:
        return registered("pruneops.pruning.decoder_cuts:NEURON_IMPORTANCES", v)


class PruneConfig(StageConfig):
    """`prune`: allocate per-unit ratios, then prune iteratively with fine-tuning between steps.

    Nested by concern: `target` (what to reach: `TargetConfig`; null for methods that take none),
    `gate` (what the result must measure: `GateConfig`), `trials` (plans trained briefly:
    `TrialsConfig`) and `distillation` (during the steps' fine-tuning: `DistillationConfig`); the
    rest says how to cut. `scope`, `importance`, `round_to` and `target` apply to some methods only
    (each method declares which); a key set for a method it does not apply to is refused, not
    ignored. `trim_vocabulary` (text models) keeps only the token embeddings the training texts
    use; other token ids read as the unknown token (the report says how often on validation and
    test text).
    """

    TASK_KEYS = task_keys(
        classification=(
            "method trials distillation scope steps schedule importance use_sensitivity round_to "
            "epochs_per_step bn_recalibration_samples trim_vocabulary lr batch_size seed"
        ),
        causal_lm="decoder",
    )

    method: str = "channel"
    target: TargetConfig | None = Field(default_factory=lambda: TargetConfig(kind="latency_ratio", value=0.5))
    gate: GateConfig = Field(default_factory=GateConfig)
    trials: TrialsConfig = Field(default_factory=TrialsConfig)
    distillation: DistillationConfig = Field(default_factory=DistillationConfig)
    decoder: DecoderCutConfig = Field(default_factory=DecoderCutConfig)
    max_unit_ratio: Ratio = 0.8
    scope: Literal["global", "layer"] | None = None
    steps: Annotated[int, Field(ge=1, le=1000)] = 4
    schedule: str = "cubic"
    importance: str | None = "l2"
    use_sensitivity: bool = True
    round_to: Annotated[int, Field(ge=1, le=4096)] | None = None
    epochs_per_step: Annotated[int, Field(ge=0, le=1000)] = 2
    bn_recalibration_samples: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    trim_vocabulary: bool = False
    lr: LearningRate = 1e-3
    batch_size: BatchSize = 64
    seed: Seed = 0
    threads: Threads = 2

    @model_validator(mode="before")
    @classmethod
    def _moved_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        for old, new in MOVED_PRUNE_KEYS.items():
            if old in data:
                raise ValueError(f"{old}: moved to prune.{new} (the section nests target, gate, trials, distillation)")
        if isinstance(data.get("target"), str):
            raise ValueError(
                f"target: a block now, e.g. target: {{kind: {data['target']}, value: 0.5}} (value was target_value)"
            )
        return data

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        return registered("pruneops.pruning.methods:METHODS", v)

    @field_validator("schedule")
    @classmethod
    def _known_schedule(cls, v: str) -> str:
        return registered("pruneops.pruning.schedule:SCHEDULES", v)

    @field_validator("importance")
    @classmethod
    def _known_importance(cls, v: str | None) -> str | None:
        return v if v is None else registered("pruneops.pruning.importance:IMPORTANCES", v)

    @model_validator(mode="after")
    def _keys_apply_to_method(self) -> PruneConfig:
        method = lookup("pruneops.pruning.methods:METHODS", self.method)
        every = lookup("pruneops.pruning.methods:registered_methods", "all")
        self._check_target(method)
        for key in ("target", "scope", "importance", "round_to"):
            value = getattr(self, key)
            users = ", ".join(name for name, cls in every.items() if key in cls.options)
            if value is not None and key not in method.options:
                raise ValueError(
                    f"{key}: does not apply to method {self.method!r} (it applies to: {users}); "
                    "remove it or set it to null"
                )
            if value is None and key in method.required:
                raise ValueError(f"{key}: required by method {self.method!r}")
        if self.importance is not None and method.importances and self.importance not in method.importances:
            raise ValueError(
                f"importance: method {self.method!r} ranks weights by {' or '.join(sorted(method.importances))}, "
                f"not {self.importance!r}"
            )
        return self

    def _check_target(self, method: Any) -> None:
        kind = self.target_kind
        if kind in ("macs", "params", *LATENCY_TARGETS) and not method.structured:
            raise ValueError(f"target.kind: {kind} targets need a structured method, not {self.method!r}")
        if kind not in LATENCY_TARGETS and self.trials.count is not None:
            raise ValueError(f"trials.count: ranks latency plans only (target kind is {kind!r}); set null")

    @property
    def target_kind(self) -> TargetKind | None:
        """The target's kind (None without a target)."""
        return None if self.target is None else self.target.kind

    @property
    def latency_target(self) -> bool:
        """Whether the target is a latency (`latency_ms` or `latency_ratio`)."""
        return self.target is not None and self.target.is_latency

    @property
    def latency_form(self) -> str:
        """The form latency is planned and gated in: `target.form` (fp32 without a target)."""
        return "fp32" if self.target is None else self.target.form

    @property
    def reference_file(self) -> Path | None:
        """`target.reference` as a path (None without one)."""
        return None if self.target is None else self.target.reference_file

    @property
    def mildest_ratio(self) -> float:
        """The slowest a pruned model may be, as a fraction of dense: what the gate's `min_speedup` lets pass."""
        return 1.0 / self.gate.min_speedup if self.gate.min_speedup else 1.0

    def reference_aim(self, of_dense: float) -> tuple[float, str | None]:
        """A reference measured at `of_dense` of dense's time: the ratio of dense to plan for, and why it was held.

        The ratio asked of the reference becomes a ratio of dense, at most `mildest_ratio`; the note
        (None when not held) says so.
        """
        wanted = self.target.value * of_dense
        ratio = min(wanted, self.mildest_ratio)
        if ratio >= wanted:
            return ratio, None
        # A null min_speedup cannot be formatted: that case is held to dense's own time.
        held = (
            f"1/prune.gate.min_speedup ({ratio:.3f})"
            if self.gate.min_speedup
            else "dense's time (prune.gate.min_speedup null)"
        )
        return ratio, f"the reference measured {of_dense:.3f} of dense: the target is held to {held} instead"

    @property
    def trial_count(self) -> int:
        """How many latency plans are trained briefly and compared (1: none; see `TrialsConfig`)."""
        if not self.latency_target:
            return 1
        return DEFAULT_PLAN_TRIALS if self.trials.count is None else self.trials.count

    @property
    def criterion(self) -> str:
        """The importance criterion in effect (`l2` where the method takes one but none is set)."""
        return self.importance or "l2"

    def with_target(self, **update: Any) -> PruneConfig:
        """Another config, its target's fields updated (as a test or a bench variant builds one).

        Planning never calls it: a loaded config is not rewritten; the target as planned is a
        `pruneops.planning.target.ResolvedTarget`.
        """
        return self.model_copy(update={"target": self.target.model_copy(update=update)})
