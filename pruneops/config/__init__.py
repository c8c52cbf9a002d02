"""Typed, validated configuration: one model per `params.yaml` section (= DVC stage).

Every section rejects unknown keys, wrong types, non-finite numbers and out-of-range values with
a `ConfigError` whose message is one line naming the key and what is allowed. Every count, size
and thread number has an upper bound: a value that parses but cannot make sense (a million
threads, a billion epochs) is refused here rather than crashing or exhausting the machine later.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import Field, field_validator, model_validator

from pruneops.config.base import (
    TASK_NOUNS,
    BatchSize,
    Epochs,
    Fraction,
    LearningRate,
    Ratio,
    Seed,
    StageConfig,
    Text,
    Threads,
    importable,
    keys_of_other_task,
    lookup,
    registered,
    task_keys,
    with_task_defaults,
)
from pruneops.config.orchestration import ComputeConfig, RepruneConfig, ServeConfig
from pruneops.config.prune import (
    AUTO_FORM,
    DEFAULT_PLAN_TRIALS,
    LATENCY_TARGETS,
    MAX_REFERENCE_RATIO,
    MOVED_PRUNE_KEYS,
    DecoderCutConfig,
    DistillationConfig,
    GateConfig,
    PruneConfig,
    TargetConfig,
    TargetKind,
    TrialsConfig,
)
from pruneops.core.errors import ConfigError

# `validate.dataset: corpus`: documents a causal LM is scored on, in token blocks.
CORPUS_DATASET = "corpus"

# `train.task`: a classifier (the default), or a pretrained decoder LLM adopted as it is.
Task = Literal["classification", "causal_lm"]

__all__ = [
    "TASK_NOUNS",
    "keys_of_other_task",
    "with_task_defaults",
    "AUTO_FORM",
    "ComputeConfig",
    "CORPUS_DATASET",
    "DecoderCutConfig",
    "AugmentConfig",
    "BatchSize",
    "BenchmarkConfig",
    "ConfigError",
    "DEFAULT_PLAN_TRIALS",
    "DistillationConfig",
    "Epochs",
    "ExportConfig",
    "FinetuneConfig",
    "FitParams",
    "Fraction",
    "GateConfig",
    "LATENCY_TARGETS",
    "LatencyConfig",
    "LearningRate",
    "MAX_REFERENCE_RATIO",
    "MOVED_PRUNE_KEYS",
    "PreprocessConfig",
    "PruneConfig",
    "QuantizeConfig",
    "Ratio",
    "RepruneConfig",
    "Seed",
    "SensitivityConfig",
    "ServeConfig",
    "StageConfig",
    "TargetConfig",
    "TargetKind",
    "Text",
    "Task",
    "Threads",
    "TrainConfig",
    "TrialsConfig",
    "ValidateConfig",
    "lookup",
    "registered",
]


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

    TASK_KEYS = task_keys(
        classification=(
            "label_column feature_columns classes value_range max_train_samples min_samples_per_class "
            "max_class_imbalance hist_bins exclude_labels max_length"
        ),
        causal_lm=(
            "block_length max_unknown_token_rate general_text general_blocks zero_shot zero_shot_prompt "
            "zero_shot_labels zero_shot_label_column zero_shot_items"
        ),
    )

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
    # dataset `corpus` (a causal LM's documents): tokens per block, and the most tokens the
    # tokenizer may map to its unknown token.
    block_length: Annotated[int, Field(ge=16, le=8192)] = 256
    max_unknown_token_rate: Ratio = 0.01
    # dataset `corpus`: general text beyond the user's domain (read as `path` is), whose perplexity the
    # benchmark reports beside the corpus's, on at most `general_blocks` blocks.
    general_text: Text | None = None
    general_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    # dataset `corpus`: a zero-shot check, a labelled file (CSV/TSV/JSONL/Parquet: `text_column`,
    # `zero_shot_label_column`) whose texts, in `zero_shot_prompt` ({text} marks where), the model
    # answers by the likeliest of `zero_shot_labels` (null: the file's labels); at most
    # `zero_shot_items` items (drawn with `seed` across a longer file), alternately in a half that
    # gates and a half that is reported. 2,000: a 1,000-item gating half, where an 8-bit form that
    # changes 4-5 % of the answers has an interval of about ±1.3 points (±3 on 200: the 3-point budget
    # then refused such forms or let them through by the draw; studies/decoder/zero_shot_items.json).
    zero_shot: Text | None = None
    zero_shot_prompt: Text = "{text}\nAnswer:"
    zero_shot_labels: Annotated[list[Text], Field(min_length=2, max_length=1000)] | None = None
    zero_shot_label_column: Text = "label"
    zero_shot_items: Annotated[int, Field(ge=4, le=100_000)] = 2000

    @field_validator("zero_shot_prompt")
    @classmethod
    def _marks_the_text(cls, v: str) -> str:
        if "{text}" not in v:
            raise ValueError("must mark where the text goes with {text}")
        return v

    @model_validator(mode="after")
    def _text_needs_a_tokenizer(self) -> ValidateConfig:
        if self.dataset in ("text", CORPUS_DATASET) and not self.tokenizer:
            raise ValueError(
                f"tokenizer: required for dataset {self.dataset!r} (a tokenizer.json, the model's folder or .gguf)"
            )
        if self.dataset == CORPUS_DATASET and not self.path:
            raise ValueError("path: dataset 'corpus' reads documents from a text, JSONL, CSV or Parquet file")
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
        if v == CORPUS_DATASET:  # documents for a causal LM: blocks, not samples (pruneops.task.causal_lm)
            return v
        try:
            return registered("pruneops.data.loaders:LOADERS", v)
        except ValueError as exc:
            raise ValueError(f"{exc}; or {CORPUS_DATASET} (documents for a causal LM)") from None


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

    TASK_KEYS = task_keys(
        classification=(
            "model_kwargs classifier lr warmup_epochs freeze_backbone_epochs init_weights init_strict "
            "reset_classifier preprocess augment batch_size weight_decay patience seed"
        ),
    )

    task: Task = "classification"
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
        if ":" in v:  # the user's own factory: imported by the stage that builds the model, not here
            return importable(v)
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
        if self.task == "causal_lm" and (self.model != "hf" or self.epochs != 0):
            raise ValueError(
                "task: causal_lm adopts a pretrained decoder as it is (model: hf, pretrained: its folder or "
                ".gguf, epochs: 0); PruneOps does not pretrain language models"
            )
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

    TASK_KEYS = task_keys(
        classification=(
            "ratios importance estimator fisher_samples bn_recalibration_samples val_samples batch_size seed"
        ),
        causal_lm="val_blocks",
    )

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
    # Causal LMs: validation blocks each layer's removal is scored on (null: all of them).
    val_blocks: Annotated[int, Field(ge=1, le=10_000_000)] | None = None
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


class LatencyConfig(StageConfig):
    """`latency`: the latency table of the model's units on this machine (latency targets only).

    Measured at `benchmark.threads` and every batch a target may name, in `prune.target.form`:
    its own stage so that changing the form, the target or the benchmark's batches re-times the
    units without sweeping their accuracy again (the sweep took 11 min on a MobileNetV2-style model).
    """

    TASK_KEYS = task_keys(
        classification="unit_points",
    )

    # Exports per unit alone, at its efficient widths, that the cost model is fitted on besides
    # dense and four uniform cuts: each is one ONNX export and one timed session.
    unit_points: Annotated[int, Field(ge=1, le=16)] = 4
    threads: Threads = 2


class FinetuneConfig(FitParams):
    """`finetune`: recovery fine-tuning with knowledge distillation from the baseline (0 epochs: none)."""

    TASK_KEYS = task_keys(
        classification=(
            "epochs patience hidden_distill_weight distill_schedule augment nproc_per_node nnodes "
            "rdzv_endpoint rdzv_id teacher_runtime"
        ),
        causal_lm="max_tokens compute_dtype device lora_rank lora_alpha self_text_fraction",
    )
    # A causal LM's recovery: 4 blocks a step (64 would hold 64 blocks' logits over the whole
    # vocabulary at once: 3 GiB each for a 49k vocabulary), a gentle rate, unsoftened logits.
    TASK_DEFAULTS = {"causal_lm": {"batch_size": 4, "lr": 3e-4, "distill_temperature": 1.0}}

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
    # Data-parallel fine-tuning under torchrun (DDP over gloo on CPU, rank 0 writes): processes on
    # each node, nodes, and where the nodes meet (c10d rendezvous; every node runs `pruneops finetune`
    # with the same params, and each reads the same project: a shared volume or `dvc pull`).
    nproc_per_node: Annotated[int, Field(ge=1, le=256)] = 1
    nnodes: Annotated[int, Field(ge=1, le=1024)] = 1
    rdzv_endpoint: Annotated[str, Field(pattern=r"^[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")] | None = None
    rdzv_id: Annotated[str, Field(pattern=r"^[A-Za-z0-9_\-]{1,64}$")] = "pruneops-finetune"
    # Where the frozen teacher runs when its outputs cannot be cached (augmented inputs):
    # `onnxruntime` exports it once and runs it ~3x faster on a CPU (MobileNetV2 at 64x64),
    # checked against PyTorch first. Layer-wise distillation needs its blocks' outputs: torch.
    teacher_runtime: Literal["torch", "onnxruntime"] = "torch"
    # Causal LMs: the distillation budget in training tokens (logit KL from the unpruned model,
    # `lr` with warm-up and cosine decay, `batch_size` blocks per step); 0: the cut model as it is.
    max_tokens: Annotated[int, Field(ge=0, le=10**12)] = 0
    # Causal LMs: bf16 runs recovery's forward passes under CPU autocast (weights and optimiser stay
    # fp32): more tokens per second where the CPU has bfloat16 instructions (avx512_bf16, AMX),
    # slower where it emulates them (the run warns).
    compute_dtype: Literal["fp32", "bf16"] = "fp32"
    # Causal LMs: where recovery trains: `cpu`, or `cuda` / `cuda:N` (refused where torch sees no
    # such device). The recovered model is saved from the CPU either way.
    device: Annotated[str, Field(pattern=r"^(cpu|cuda(:[0-9]{1,2})?)$")] = "cpu"
    # Causal LMs: null trains every weight; a rank trains LoRA adapters of every decoder-layer
    # projection alone (scale lora_alpha / lora_rank), merged into the weights after recovery.
    lora_rank: Annotated[int, Field(ge=1, le=65536)] | None = None
    lora_alpha: Annotated[float, Field(gt=0.0, le=1e6)] = 16.0
    # Causal LMs: the share of recovery blocks the dense model writes itself (sampled from the first
    # tokens of training blocks), so that distillation also sees text beyond the corpus, with no data
    # the user lacks; 0: the corpus alone.
    self_text_fraction: Annotated[float, Field(ge=0.0, le=0.9)] = 0.0

    @model_validator(mode="after")
    def _nodes_meet_somewhere(self) -> FinetuneConfig:
        if self.nnodes > 1 and self.rdzv_endpoint is None:
            raise ValueError("nnodes > 1 needs rdzv_endpoint (host:port where the nodes meet, e.g. node 0's)")
        return self

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

    TASK_KEYS = task_keys(
        classification=(
            "method calibration_samples per_channel activation_type accuracy_tolerance latency_repeats "
            "opset exporter reduce_range"
        ),
        causal_lm=(
            "decoder_precisions gguf_precisions perplexity_tolerance other_metric_tolerance decoder_vocabulary "
            "decoder_tail_groups"
        ),
    )

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
    # Causal LMs: the weight precisions tried beside fp32 (onnxruntime-genai), and the most
    # validation perplexity a precision may add (relative) to ship.
    decoder_precisions: list[Literal["int8", "int4"]] = Field(default_factory=lambda: ["int8", "int4"])
    # Causal LMs served by llama.cpp (`export.runtime`): the GGUF types tried beside fp32.
    gguf_precisions: list[Literal["f16", "q8_0", "q4_k_m"]] = Field(default_factory=lambda: ["q8_0", "q4_k_m"])
    perplexity_tolerance: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    # Causal LMs: the most a form may be slower than dense fp32 (what is served today) in the metric it
    # is not chosen on (to the first token where prune.target's metric is decode, per output token where
    # it is prefill), relative: 0.1 = 10 % (null: not judged; a form that decodes faster but prefills
    # slower than dense then ships on decode alone).
    other_metric_tolerance: Annotated[float, Field(ge=0.0, le=100.0)] | None = 0.1
    # Causal LMs: output vocabulary sizes tried beside the full one, each in every precision: that
    # many tokens keep their row of the output projection, the rest are scored through
    # `decoder_tail_groups` fitted tail logits.
    decoder_vocabulary: list[Annotated[int, Field(ge=2, le=10_000_000)]] = Field(default_factory=list)
    # The tail logits the dropped tokens share, grouped by k-means on their output rows.
    decoder_tail_groups: Annotated[int, Field(ge=1, le=1_000_000)] = 256

    @field_validator("method")
    @classmethod
    def _known_quantizer(cls, v: str) -> str:
        return v if v == "auto" else registered("pruneops.runtimes.onnxruntime.quantizers:QUANTIZERS", v)

    @field_validator("exporter")
    @classmethod
    def _known_exporter(cls, v: str) -> str:
        return registered("pruneops.runtimes.onnxruntime.files:EXPORTERS", v)


class ExportConfig(StageConfig):
    """`export`: ONNX with a dynamic batch axis, parity-checked; TensorRT where present."""

    TASK_KEYS = task_keys(
        classification="opset exporter parity_atol parity_samples tensorrt",
        causal_lm="greedy_tokens runtime",
    )

    opset: Annotated[int, Field(ge=13, le=23)] = 18
    exporter: str = "torchscript"
    parity_atol: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    parity_samples: Annotated[int, Field(ge=1, le=1_000_000)] = 128
    tensorrt: bool = True
    # Causal LMs: greedy tokens the exported fp32 model must generate exactly as torch does.
    greedy_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    # Causal LMs: the runtime that serves (`genai`, `llamacpp`), or `auto`: every runtime that can
    # serve the model's family here is a candidate, and the fastest measured within the budgets ships.
    runtime: str = "auto"

    @field_validator("runtime")
    @classmethod
    def _known_runtime(cls, v: str) -> str:
        return registered("pruneops.runtimes:causal_lm_runtime", v)

    @field_validator("exporter")
    @classmethod
    def _known_exporter(cls, v: str) -> str:
        return registered("pruneops.runtimes.onnxruntime.files:EXPORTERS", v)


class BenchmarkConfig(StageConfig):
    """`benchmark`: latency, throughput, size and accuracy of each exported model."""

    TASK_KEYS = task_keys(
        classification="warmup repeats",
        causal_lm="prompt_length new_tokens",
    )

    threads: Threads = 1
    batch_sizes: Annotated[list[Annotated[int, Field(ge=1, le=4096)]], Field(min_length=1, max_length=16)] = Field(
        default_factory=lambda: [1, 64]
    )
    warmup: Annotated[int, Field(ge=0, le=100_000)] = 20
    repeats: Annotated[int, Field(ge=1, le=1_000_000)] = 100
    rounds: Annotated[int, Field(ge=1, le=1000)] = 5
    # Causal LMs: time to first token after a prompt of `prompt_length` tokens, then the time
    # per output token over `new_tokens` generated tokens, at each of `batch_sizes`.
    prompt_length: Annotated[int, Field(ge=1, le=32_768)] = 256
    new_tokens: Annotated[int, Field(ge=2, le=4096)] = 32


# Sections that configure the orchestration around the stages rather than a stage.
EXTRA_SECTIONS: dict[str, type[StageConfig]] = {
    "reprune": RepruneConfig,
    "serve": ServeConfig,
    "compute": ComputeConfig,
}
