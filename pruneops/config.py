"""Typed, validated configuration: one model per `params.yaml` section (= DVC stage).

Every section rejects unknown keys, wrong types, non-finite numbers and out-of-range values with
a `ConfigError` whose message is one line naming the key and what is allowed. Every count, size
and thread number has an upper bound: a value that parses but cannot make sense (a million
threads, a billion epochs) is refused here rather than crashing or exhausting the machine later.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from pruneops.errors import ConfigError

Ratio = Annotated[float, Field(ge=0.0, lt=1.0)]

Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]

Threads = Annotated[int, Field(ge=1, le=256)]

Epochs = Annotated[int, Field(ge=1, le=10_000)]

BatchSize = Annotated[int, Field(ge=1, le=65_536)]

Seed = Annotated[int, Field(ge=0, lt=2**32)]

LearningRate = Annotated[float, Field(gt=0.0, le=1.0)]

# Names and paths: non-empty, no NUL byte (the OS refuses it), not a novel's length.
Text = Annotated[str, Field(min_length=1, max_length=4096, pattern=r"^[^\x00]*$")]


class StageConfig(BaseModel):
    """Base of every stage config: strict types, no unknown keys, finite numbers, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True, allow_inf_nan=False)


def lookup(target: str, name: str) -> Any:
    """Resolves `name` through a registry (or resolver function) given as `module:attribute`.

    The module is named by a string and imported on first use: a name check passes or fails a
    config and cannot change a stage's outputs, so `pruneops.dvcfile` does not count the registry
    module among the stage's code dependencies.

    Raises:
        ValueError: Unknown name; the message lists the known ones.
    """
    module, _, attr = target.partition(":")
    found = getattr(importlib.import_module(module), attr)
    try:
        return found(name) if callable(found) and not hasattr(found, "get") else found.get(name)
    except ConfigError as exc:
        raise ValueError(str(exc).removeprefix("train.model: ")) from None


def registered(registry: str, name: str) -> str:
    """`name`, after checking it against `registry` (see `lookup`)."""
    lookup(registry, name)
    return name


class AugmentConfig(StageConfig):
    """`augment` of `train` and `finetune`: random changes to every training batch of images.

    Applied to the raw inputs (channels, height, width) before the model's `preprocess`:
    `crop_padding` pads each image by that many zero pixels on every side and crops it back to
    its size at a random offset; `hflip` mirrors each image left-right with probability 1/2
    (right for photos and clothing, wrong for digits and text). Validation and test never are.
    """

    crop_padding: Annotated[int, Field(ge=0, le=256)] = 0
    hflip: bool = False


class FitParams(StageConfig):
    """What every training loop takes (baseline, between pruning steps, fine-tuning)."""

    augment: AugmentConfig | None = None
    epochs: Epochs = 30
    batch_size: BatchSize = 64
    lr: LearningRate = 3e-3
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 1e-4
    patience: Epochs = 5  # stale epochs that stop a run, not before the LR is half its peak
    seed: Seed = 0
    threads: Threads = 2

    @property
    def resolved_lr(self) -> float:
        """The LR the loop uses (`train` defaults it by whether weights are given)."""
        return self.lr

    @property
    def resolved_warmup_epochs(self) -> float:
        """Linear LR warm-up in epochs (none unless a section says otherwise)."""
        return 0.0

    @property
    def frozen_epochs(self) -> int:
        """Epochs during which only the classifier trains (none unless a section says otherwise)."""
        return 0


class ValidateConfig(StageConfig):
    """`validate`: load the data, split it, check it with Great Expectations."""

    dataset: Text = "digits"
    path: Text | None = None
    label_column: Text = "label"
    feature_columns: Annotated[list[Text], Field(min_length=1, max_length=100_000)] | None = None
    classes: Annotated[list[Annotated[int, Field(ge=0, lt=100_000)]], Field(min_length=2)] | None = None
    value_range: list[Annotated[float, Field(ge=-1e30, le=1e30)]] | None = None
    val_fraction: Fraction = 0.15
    test_fraction: Fraction = 0.2
    max_train_samples: Annotated[int, Field(ge=10, le=1_000_000_000)] | None = None
    min_samples_per_class: Annotated[int, Field(ge=1, le=1_000_000)] = 5
    # Largest allowed ratio of the biggest class's training count to the smallest's (null: not checked).
    max_class_imbalance: Annotated[float, Field(ge=1.0, le=1e9)] | None = None
    max_leakage_fraction: Ratio = 0.0
    hist_bins: Annotated[int, Field(ge=2, le=256)] = 20
    seed: Seed = 0
    # dataset `text`: a table of sentences, tokenised by the model's own tokenizer.json.
    text_column: Text = "text"
    encoding: Text = "utf-8"
    exclude_labels: Annotated[list[Text], Field(max_length=1000)] | None = None
    tokenizer: Text | None = None  # a tokenizer.json, or the pretrained model's folder holding one
    max_length: Annotated[int, Field(ge=8, le=4096)] | None = None  # null: the p95 token length, rounded up to 8
    min_text_chars: Annotated[int, Field(ge=1, le=1_000_000)] = 1
    max_text_chars: Annotated[int, Field(ge=1, le=10_000_000)] = 20_000
    drop_duplicates: bool = True  # repeats of an earlier (normalised) text are dropped before splitting
    max_duplicate_fraction: Ratio = 0.0  # checked when drop_duplicates is false

    @model_validator(mode="after")
    def _text_needs_a_tokenizer(self) -> ValidateConfig:
        if self.dataset == "text" and not self.tokenizer:
            raise ValueError("tokenizer: required for dataset 'text' (a tokenizer.json or the model's folder)")
        return self

    @field_validator("value_range")
    @classmethod
    def _ordered(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (len(v) != 2 or not v[0] < v[1]):
            raise ValueError("must be [low, high] with low < high")
        return v

    @field_validator("dataset")
    @classmethod
    def _known_dataset(cls, v: str) -> str:
        return registered("pruneops.data.loaders:LOADERS", v)


class PreprocessConfig(StageConfig):
    """`train.preprocess`: what the model does to raw inputs first (saved with it, run by serving).

    `resize` to [height, width] (bilinear), `channels` repeats a 1-channel image (grayscale to 3
    for an ImageNet backbone), then `(x - mean) / std` per channel on inputs already scaled to
    [0, 1] by `validate` (ImageNet: mean [0.485, 0.456, 0.406], std [0.229, 0.224, 0.225]).
    """

    resize: Annotated[list[Annotated[int, Field(ge=1, le=4096)]], Field(min_length=2, max_length=2)] | None = None
    channels: Annotated[int, Field(ge=1, le=64)] | None = None
    mean: Annotated[list[Annotated[float, Field(ge=-1e6, le=1e6)]], Field(min_length=1, max_length=64)] | None = None
    std: Annotated[list[Annotated[float, Field(gt=0.0, le=1e6)]], Field(min_length=1, max_length=64)] | None = None


SCRATCH_LR, PRETRAINED_LR = 3e-3, 1e-3  # fine-tuning pretrained weights at the from-scratch LR undoes them

# Pretrained transformers forget at CNN fine-tuning rates: the usual BERT-family range is 2e-5..1e-4.
TRANSFORMER_LR, TRANSFORMER_WARMUP = 5e-5, 0.1


class TrainConfig(FitParams):
    """`train`: the baseline model, trained from scratch or from the user's weights.

    `init_weights` (safetensors, or a torch state dict read with `weights_only`) is loaded before
    training; `epochs: 0` adopts it as the baseline as it is. The classifier is re-initialised
    when the file's has another class count (`reset_classifier: null`), always (`true`) or never
    (`false`: a mismatch is an error). `lr` and `warmup_epochs` default by whether weights are
    given (`null`): 3e-3 and none from scratch, 1e-3 and one warm-up epoch from weights.

    `model: hf` builds a HuggingFace sequence classifier from `pretrained` (a local folder with
    `config.json` and weights; nothing is downloaded) with a new head for the data's classes,
    fine-tuned at 5e-5 with a 0.1-epoch warm-up by default; `epochs: 0` adopts a folder that is
    already a classifier for these classes as it is. `model_kwargs` override its config.
    """

    model: Text = "cnn"
    pretrained: Text | None = None
    model_kwargs: dict[str, Any] = Field(default_factory=dict)
    # The output layer (never pruned); null finds it from the forward pass.
    classifier: Text | None = None
    epochs: Annotated[int, Field(ge=0, le=10_000)] = 30
    lr: LearningRate | None = None
    warmup_epochs: Annotated[float, Field(ge=0.0, le=1_000.0)] | None = None
    freeze_backbone_epochs: Annotated[int, Field(ge=0, le=10_000)] = 0
    init_weights: Text | None = None
    init_strict: bool = True
    reset_classifier: bool | None = None
    preprocess: PreprocessConfig | None = None

    @field_validator("model")
    @classmethod
    def _known_model(cls, v: str) -> str:
        return registered("pruneops.models.registry:resolve_factory", v)

    @model_validator(mode="after")
    def _weights_for_adoption(self) -> TrainConfig:
        if self.model == "hf" and not self.pretrained:
            raise ValueError("pretrained: model 'hf' needs the local folder of a pretrained model")
        if self.pretrained and self.model != "hf":
            raise ValueError(f"pretrained: only for model 'hf' (model is {self.model!r}; use init_weights)")
        if self.epochs == 0 and self.init_weights is None and self.pretrained is None:
            raise ValueError("epochs: 0 adopts train.init_weights as the baseline; set init_weights (or epochs >= 1)")
        if self.freeze_backbone_epochs > self.epochs:
            raise ValueError(f"freeze_backbone_epochs: {self.freeze_backbone_epochs} exceeds epochs {self.epochs}")
        return self

    @property
    def resolved_lr(self) -> float:
        """The LR used: `lr`, or its default for training from scratch or from weights."""
        if self.lr is not None:
            return self.lr
        if self.pretrained:
            return TRANSFORMER_LR
        return PRETRAINED_LR if self.init_weights else SCRATCH_LR

    @property
    def resolved_warmup_epochs(self) -> float:
        """Linear LR warm-up in epochs: `warmup_epochs`, or 1 from weights and 0 from scratch."""
        if self.warmup_epochs is not None:
            return self.warmup_epochs
        if self.pretrained:
            return TRANSFORMER_WARMUP
        return 1.0 if self.init_weights else 0.0

    @property
    def frozen_epochs(self) -> int:
        """`freeze_backbone_epochs`."""
        return self.freeze_backbone_epochs


class SensitivityConfig(StageConfig):
    """`sensitivity`: prune each unit alone at a sweep of ratios."""

    ratios: Annotated[list[Ratio], Field(max_length=64)] = Field(
        default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8]
    )
    importance: str = "l2"
    # How each unit's cost at each ratio is found: `evaluate` prunes it alone and measures the
    # validation accuracy drop (one evaluation per unit and ratio); `fisher` predicts the loss
    # increase from the Fisher information of a mask on its heads/neurons over `fisher_samples`
    # training samples (Kwon et al. 2022), with no evaluation: minutes instead of tens of minutes
    # on a transformer, for heads and channels that feed a Linear (structured methods).
    estimator: str = "evaluate"
    fisher_samples: Annotated[int, Field(ge=1, le=10_000_000)] = 2048
    # Re-estimate BatchNorm statistics on this many training samples before scoring each trial:
    # without it a pruned residual group collapses to chance, every ratio looks equally bad and
    # the allocation learns nothing (adaptive BN, Li et al. 2020, "EagleEye"). 0 turns it off.
    bn_recalibration_samples: Annotated[int, Field(ge=0, le=10_000_000)] = 512
    # Score the trials on this many validation samples (drawn by `seed`, every class kept in
    # proportion); null: all of them. Each trial is one evaluation, so the sweep's time scales
    # with it: MobileNetV2 at 64x64 spent ~7 of ~9 s per trial on 6,000 images. The ranking
    # needs less than the final accuracy does (a drop's standard error at 2,000 samples is ~0.5
    # pt), but fewer samples lower the line below which a point counts as at chance: on the
    # vision workload 1,000 images gave a shallower plan than 6,000 (3.92x vs 4.40x at batch 64).
    val_samples: Annotated[int, Field(ge=100, le=10_000_000)] | None = None
    batch_size: BatchSize = 256
    seed: Seed = 0
    threads: Threads = 2

    @field_validator("ratios")
    @classmethod
    def _non_empty(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("must list at least one ratio")
        return sorted(set(v))

    @field_validator("importance")
    @classmethod
    def _known_importance(cls, v: str) -> str:
        return registered("pruneops.pruning.importance:IMPORTANCES", v)

    @field_validator("estimator")
    @classmethod
    def _known_estimator(cls, v: str) -> str:
        return registered("pruneops.planning.sensitivity:ESTIMATORS", v)


LATENCY_TARGETS = ("latency_ms", "latency_ratio")

# `prune.latency_form: auto`: plan in every form the quantize stage may ship, keep the cheapest plan.
AUTO_FORM = "auto"


class LatencyConfig(StageConfig):
    """`latency`: the latency table of the model's units on this machine (latency targets only).

    Measured at `benchmark.threads` and every batch a target may name, in `prune.latency_form`:
    its own stage so that changing the form, the target or the benchmark's batches re-times the
    units without sweeping their accuracy again (the sweep took 11 min on a MobileNetV2-style model).
    """

    # Exports per unit alone, at its efficient widths, that the cost model is fitted on besides
    # dense and four uniform cuts: each is one ONNX export and one timed session.
    unit_points: Annotated[int, Field(ge=1, le=16)] = 4
    threads: Threads = 2


# A ratio of a reference model's latency may exceed 1 (slower than the reference, faster than dense),
# but a plan is never slower than dense: past this the target is not a pruning target.
MAX_REFERENCE_RATIO = 4.0

DEFAULT_PLAN_TRIALS = 4  # plans trained briefly per latency allocation: the best uniform cut and three others


class PruneConfig(StageConfig):
    """`prune`: allocate per-unit ratios, then prune iteratively with fine-tuning between steps.

    `target` says what to reach and `target_value` how much: `ratio` (fraction of channels/heads,
    MAC-weighted, or of weights to remove), `macs` or `params` (the most one sample's forward pass
    may cost, or the model may hold), `latency_ms` or `latency_ratio` (predicted latency at
    `target_batch` on this machine, in milliseconds or as a fraction of dense; structured methods).
    `target_reference` (with `latency_ratio`): an ONNX file (relative to the project) whose latency
    the ratio is of instead of dense's: 1.0 asks to be as fast as that model (one served now, or
    another pruning tool's result), which the gate times interleaved with dense and each plan, so
    that the comparison holds in whatever state the machine is in. It is timed as it is (not
    quantized); its inputs must be named as the model's export names them.
    `latency_form` is the form that latency, and the gate's, is measured in: `fp32`, or a
    quantizer's name (`static`, `dynamic`) when that is what will be deployed: INT8 and fp32 do not
    rank plans alike (INT8 kernels have their own fast channel counts and per-operator costs).
    `auto` plans in every form the quantize stage may ship (each `quantize.method: auto` candidate,
    or the one method named) and keeps the plan that meets the target with the least predicted
    accuracy loss; a `latency_ratio` is then of dense fp32, so an INT8 form needs fewer cuts.
    `target`, `scope`, `importance` and `round_to` apply to some methods only (each method
    declares which); a key set for a method it does not apply to is refused, not ignored.
    `min_speedup` is the gate: a structured result must be measured at least this much faster
    than dense at batch 1, and not slower at the benchmark's largest batch (null: measured and
    reported, not gated). `trim_vocabulary` (text models) keeps only the token embeddings the
    training texts use; other token ids read as the unknown token (the report says how often on
    validation and test text). `plan_trials` (latency targets): how many feasible plans of the
    allocation (least summed isolated drop first, the best uniform cut among them) are each pruned
    into a copy, BatchNorm-recalibrated and trained one pass over `trial_samples` training samples;
    the best on validation replaces the allocation's own plan where it is better by more than two
    paired standard errors (NetAdapt's short-term fine-tuning, `pruneops.stages.prune.PlanTrials`); at deep
    cuts the sweep's isolated drops rank plans against what fine-tuning recovers. 1: no trials;
    null: 4 for latency targets.
    """

    method: str = "channel"
    target: Literal["ratio", "macs", "params", "latency_ms", "latency_ratio"] | None = "latency_ratio"
    target_value: Annotated[float, Field(ge=0.0, le=1e18)] | None = 0.5
    target_batch: Annotated[int, Field(ge=1, le=4096)] | None = 1
    target_reference: str | None = None
    min_speedup: Annotated[float, Field(ge=1.0, le=100.0)] | None = 1.05
    latency_form: str = "fp32"
    max_unit_ratio: Ratio = 0.8
    scope: Literal["global", "layer"] | None = None
    steps: Annotated[int, Field(ge=1, le=1000)] = 4
    schedule: str = "cubic"
    importance: str | None = "l2"
    use_sensitivity: bool = True
    round_to: Annotated[int, Field(ge=1, le=4096)] | None = None
    epochs_per_step: Annotated[int, Field(ge=0, le=1000)] = 2
    bn_recalibration_samples: Annotated[int, Field(ge=0, le=10_000_000)] = 0
    distill_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.0
    distill_temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 4.0
    hidden_distill_weight: Annotated[float, Field(ge=0.0, le=1000.0)] = 0.0
    trim_vocabulary: bool = False
    plan_trials: Annotated[int, Field(ge=1, le=64)] | None = None  # latency targets: DEFAULT_PLAN_TRIALS
    trial_samples: Annotated[int, Field(ge=1, le=10_000_000)] = 3200
    lr: LearningRate = 1e-3
    batch_size: BatchSize = 64
    seed: Seed = 0
    threads: Threads = 2

    @field_validator("method")
    @classmethod
    def _known_method(cls, v: str) -> str:
        return registered("pruneops.pruning.methods:METHODS", v)

    @field_validator("latency_form")
    @classmethod
    def _known_form(cls, v: str) -> str:
        if v == AUTO_FORM:
            return v
        try:
            return registered("pruneops.quantizers:QUANTIZERS", v)
        except ValueError as exc:
            raise ValueError(f"{exc}; or {AUTO_FORM} (plan in every form the quantize stage may ship)") from None

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
        if (self.target is None) != (self.target_value is None):
            raise ValueError("target_value: set together with prune.target (both, or both null)")
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
        value, latency = self.target_value, self.target in LATENCY_TARGETS
        if self.target_reference is not None:
            self._check_reference()
        elif self.target in ("ratio", "latency_ratio") and value is not None and not value < 1.0:
            raise ValueError(f"target_value: a ratio must be less than 1 (got {value})")
        if self.target == "latency_ratio" and not value > 0.0:
            raise ValueError(f"target_value: a latency ratio must be more than 0 (got {value})")
        if self.target in ("macs", "params", *LATENCY_TARGETS) and not method.structured:
            raise ValueError(f"target: {self.target} targets need a structured method, not {self.method!r}")
        if latency and self.target_batch is None:
            raise ValueError(f"target_batch: required by target {self.target!r} (the batch size the latency is at)")
        if not latency and self.target_batch is not None:
            raise ValueError(f"target_batch: applies to latency targets only (target is {self.target!r}); set null")
        if not latency and self.plan_trials is not None:
            raise ValueError(f"plan_trials: ranks latency plans only (target is {self.target!r}); set null")

    def _check_reference(self) -> None:
        if self.target != "latency_ratio":
            raise ValueError(f"target_reference: applies to target latency_ratio only (target is {self.target!r})")
        if not self.target_reference.endswith(".onnx"):
            raise ValueError(f"target_reference: an ONNX model file (.onnx), not {self.target_reference!r}")
        if not 0.0 < self.target_value <= MAX_REFERENCE_RATIO:
            raise ValueError(
                f"target_value: a ratio of the reference's latency must be in (0, {MAX_REFERENCE_RATIO:g}] "
                f"(got {self.target_value})"
            )

    @property
    def reference_file(self) -> Path | None:
        """`target_reference` as a path (None without one)."""
        return Path(self.target_reference) if self.target_reference else None

    @property
    def trial_count(self) -> int:
        """How many latency plans are trained briefly and compared (1: none; see the class docstring)."""
        if self.target not in LATENCY_TARGETS:
            return 1
        return DEFAULT_PLAN_TRIALS if self.plan_trials is None else self.plan_trials

    @property
    def criterion(self) -> str:
        """The importance criterion in effect (`l2` where the method takes one but none is set)."""
        return self.importance or "l2"


class FinetuneConfig(FitParams):
    """`finetune`: recovery fine-tuning with knowledge distillation from the baseline (0 epochs: none)."""

    epochs: Annotated[int, Field(ge=0, le=10_000)] = 20
    lr: LearningRate = 1e-3
    distill_temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 4.0
    distill_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    hidden_distill_weight: Annotated[float, Field(ge=0.0, le=1000.0)] = 0.0
    # `while_below_teacher` (default): an epoch distils only while the student's validation
    # accuracy is below the teacher's; from an under-trained teacher (a baseline trained for few
    # epochs) the student then learns from the labels instead of being held to the teacher's
    # errors (docs/explanation/training.md#while-below-teacher).
    distill_schedule: Literal["every_epoch", "while_below_teacher"] = "while_below_teacher"
    world_size: Annotated[int, Field(ge=1, le=16)] = 1
    # Where the frozen teacher runs when its outputs cannot be cached (augmented inputs):
    # `onnxruntime` exports it once and runs it ~3x faster on a CPU (MobileNetV2 at 64x64),
    # checked against PyTorch first. Layer-wise distillation needs its blocks' outputs: torch.
    teacher_runtime: Literal["torch", "onnxruntime"] = "torch"

    @model_validator(mode="after")
    def _teacher_runtime_gives_blocks(self) -> FinetuneConfig:
        if self.teacher_runtime == "onnxruntime" and self.hidden_distill_weight > 0:
            raise ValueError(
                "teacher_runtime onnxruntime gives logits only; hidden_distill_weight > 0 needs "
                "the teacher's block outputs: use teacher_runtime torch"
            )
        return self


class QuantizeConfig(StageConfig):
    """`quantize`: ONNX Runtime INT8 (static QDQ, dynamic, or the fastest of those and fp32)."""

    method: str = "auto"
    calibration_samples: Annotated[int, Field(ge=1, le=1_000_000)] = 256
    per_channel: bool = True
    activation_type: Literal["uint8", "int8"] = "uint8"
    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    latency_repeats: Annotated[int, Field(ge=1, le=1_000_000)] = 200
    threads: Threads = 1
    opset: Annotated[int, Field(ge=13, le=23)] = 18
    exporter: str = "torchscript"
    # Static INT8 weights in 7 bits: auto = on x86 without VNNI, whose u8 x s8 kernels saturate.
    reduce_range: bool | Literal["auto"] = "auto"

    @field_validator("method")
    @classmethod
    def _known_quantizer(cls, v: str) -> str:
        return v if v == "auto" else registered("pruneops.quantizers:QUANTIZERS", v)

    @field_validator("exporter")
    @classmethod
    def _known_exporter(cls, v: str) -> str:
        return registered("pruneops.onnx_utils:EXPORTERS", v)


class ExportConfig(StageConfig):
    """`export`: ONNX with a dynamic batch axis, parity-checked; TensorRT where present."""

    opset: Annotated[int, Field(ge=13, le=23)] = 18
    exporter: str = "torchscript"
    parity_atol: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    parity_samples: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    tensorrt: bool = True

    @field_validator("exporter")
    @classmethod
    def _known_exporter(cls, v: str) -> str:
        return registered("pruneops.onnx_utils:EXPORTERS", v)


class BenchmarkConfig(StageConfig):
    """`benchmark`: latency, throughput, size and accuracy of each exported model."""

    threads: Threads = 1
    batch_sizes: Annotated[list[Annotated[int, Field(ge=1, le=4096)]], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: [1, 64]
    )
    warmup: Annotated[int, Field(ge=0, le=100_000)] = 20
    repeats: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    rounds: Annotated[int, Field(ge=1, le=1000)] = 5


class RepruneConfig(StageConfig):
    """`reprune` (not a DVC stage): the promotion gate and drift trigger of the Prefect flows."""

    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005
    latency_slo_ms: Annotated[float, Field(gt=0.0, le=1e6)] = 1.0
    drift_threshold: Annotated[float, Field(gt=0.0, le=1e6)] = 0.2
    drift_check_cron: Annotated[str, Field(pattern=r"^\s*([0-9*/,\-]+\s+){4}[0-9*/,\-]+\s*$")] = "*/15 * * * *"
    drift_source: Text = "http://127.0.0.1:9090"
    registry_dir: Text = "models"
    feedback_dir: Text = "data/feedback"
    latency_repeats: Annotated[int, Field(ge=1, le=1_000_000)] = 200


class ServeConfig(StageConfig):
    """`serve` (not a DVC stage): the serving app's drift window, thresholds and feedback store."""

    drift_window: Annotated[int, Field(ge=10, le=1_000_000)] = 1000
    drift_min_samples: Annotated[int, Field(ge=1, le=1_000_000)] = 50
    psi_threshold: Annotated[float, Field(gt=0.0, le=1e6)] = 0.2
    ks_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    accuracy_window: Annotated[int, Field(ge=1, le=1_000_000)] = 500
    max_batch: Annotated[int, Field(ge=1, le=65_536)] = 256
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 8 * 1024 * 1024
    reload_interval_s: Annotated[float, Field(ge=0.05, le=3600.0)] = 2.0
    feedback_flush_every: Annotated[int, Field(ge=1, le=1_000_000)] = 100


# Sections that configure the orchestration around the stages rather than a stage.
EXTRA_SECTIONS: dict[str, type[StageConfig]] = {"reprune": RepruneConfig, "serve": ServeConfig}
