"""Typed, validated configuration: one model per `params.yaml` section (= DVC stage).

Every section rejects unknown keys, wrong types and out-of-range values with a `ConfigError`
whose message is one line naming the key and what is allowed.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, NonNegativeInt, ValidationError, field_validator

from pruneops.errors import ConfigError

Ratio = Annotated[float, Field(ge=0.0, lt=1.0)]
Fraction = Annotated[float, Field(gt=0.0, lt=1.0)]
PositiveInt = Annotated[int, Field(ge=1)]


class StageConfig(BaseModel):
    """Base of every stage config: strict types, no unknown keys, immutable."""

    model_config = ConfigDict(extra="forbid", strict=True, frozen=True)


class FitParams(StageConfig):
    """What every training loop takes (baseline, between pruning steps, fine-tuning)."""

    epochs: PositiveInt = 30
    batch_size: PositiveInt = 64
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 3e-3
    weight_decay: Annotated[float, Field(ge=0.0, le=1.0)] = 1e-4
    patience: PositiveInt = 5
    seed: int = 0
    threads: PositiveInt = 2


class ValidateConfig(StageConfig):
    """`validate`: load the data, split it, check it with Great Expectations."""

    dataset: str = "digits"
    path: str | None = None
    label_column: str = "label"
    feature_columns: list[str] | None = None
    classes: list[int] | None = None
    value_range: list[float] | None = None
    val_fraction: Fraction = 0.15
    test_fraction: Fraction = 0.2
    max_train_samples: PositiveInt | None = None
    min_samples_per_class: PositiveInt = 5
    max_leakage_fraction: Ratio = 0.0
    hist_bins: Annotated[int, Field(ge=2, le=256)] = 20
    seed: int = 0

    @field_validator("value_range")
    @classmethod
    def _ordered(cls, v: list[float] | None) -> list[float] | None:
        if v is not None and (len(v) != 2 or not v[0] < v[1]):
            raise ValueError("must be [low, high] with low < high")
        return v


class TrainConfig(FitParams):
    """`train`: the baseline model."""

    model: str = "cnn"
    model_kwargs: dict[str, Any] = Field(default_factory=dict)


class SensitivityConfig(StageConfig):
    """`sensitivity`: prune each group alone at a sweep of ratios."""

    ratios: list[Ratio] = Field(default_factory=lambda: [0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8])
    importance: str = "l2"
    max_layer_ratio: Ratio = 0.9
    # Re-estimate BatchNorm statistics on this many training samples before scoring each trial:
    # without it a pruned residual group collapses to chance, every ratio looks equally bad and
    # the allocation learns nothing (adaptive BN, Li et al. 2020, "EagleEye"). 0 turns it off.
    bn_recalibration_samples: NonNegativeInt = 0
    batch_size: PositiveInt = 256
    threads: PositiveInt = 2

    @field_validator("ratios")
    @classmethod
    def _non_empty(cls, v: list[float]) -> list[float]:
        if not v:
            raise ValueError("must list at least one ratio")
        return sorted(set(v))


class PruneConfig(StageConfig):
    """`prune`: iterative pruning to `target_ratio` over `steps` with fine-tuning between."""

    method: str = "channel"
    target_ratio: Ratio = 0.5
    scope: Literal["global", "layer"] = "global"
    steps: PositiveInt = 4
    schedule: Literal["cubic", "linear", "oneshot"] = "cubic"
    importance: str = "l2"
    use_sensitivity: bool = True
    round_to: PositiveInt | None = None
    epochs_per_step: Annotated[int, Field(ge=0)] = 2
    bn_recalibration_samples: NonNegativeInt = 0
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-3
    batch_size: PositiveInt = 64
    seed: int = 0
    threads: PositiveInt = 2


class FinetuneConfig(FitParams):
    """`finetune`: recovery fine-tuning with knowledge distillation from the baseline."""

    epochs: PositiveInt = 20
    lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-3
    distill_temperature: Annotated[float, Field(gt=0.0, le=100.0)] = 4.0
    distill_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 0.5
    world_size: Annotated[int, Field(ge=1, le=64)] = 1


class QuantizeConfig(StageConfig):
    """`quantize`: ONNX Runtime INT8 (static QDQ, dynamic, or the faster of the two)."""

    method: str = "auto"
    calibration_samples: PositiveInt = 256
    per_channel: bool = True
    activation_type: Literal["uint8", "int8"] = "uint8"
    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.01
    latency_repeats: PositiveInt = 200
    threads: PositiveInt = 1
    opset: Annotated[int, Field(ge=13, le=23)] = 18


class ExportConfig(StageConfig):
    """`export`: ONNX with a dynamic batch axis, parity-checked; TensorRT where present."""

    opset: Annotated[int, Field(ge=13, le=23)] = 18
    parity_atol: Annotated[float, Field(gt=0.0)] = 1e-4
    parity_samples: PositiveInt = 128
    tensorrt: bool = True


class BenchmarkConfig(StageConfig):
    """`benchmark`: latency, throughput, size and accuracy of each exported model."""

    threads: PositiveInt = 1
    batch_sizes: list[PositiveInt] = Field(default_factory=lambda: [1, 64])
    warmup: Annotated[int, Field(ge=0)] = 20
    repeats: PositiveInt = 100
    rounds: PositiveInt = 5


class RepruneConfig(StageConfig):
    """`reprune` (not a DVC stage): the promotion gate and drift trigger of the Prefect flows."""

    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005
    latency_slo_ms: Annotated[float, Field(gt=0.0)] = 1.0
    drift_threshold: Annotated[float, Field(gt=0.0)] = 0.2
    drift_check_cron: str = "*/15 * * * *"
    drift_source: str = "http://127.0.0.1:9090"
    registry_dir: str = "models"
    feedback_dir: str = "data/feedback"
    latency_repeats: PositiveInt = 200


STAGE_CONFIGS: dict[str, type[StageConfig]] = {
    "validate": ValidateConfig,
    "train": TrainConfig,
    "sensitivity": SensitivityConfig,
    "prune": PruneConfig,
    "finetune": FinetuneConfig,
    "quantize": QuantizeConfig,
    "export": ExportConfig,
    "benchmark": BenchmarkConfig,
}


class ServeConfig(StageConfig):
    """`serve` (not a DVC stage): the serving app's drift window, thresholds and feedback store."""

    drift_window: Annotated[int, Field(ge=10)] = 1000
    drift_min_samples: PositiveInt = 50
    psi_threshold: Annotated[float, Field(gt=0.0)] = 0.2
    ks_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    accuracy_window: PositiveInt = 500
    max_batch: PositiveInt = 256
    reload_interval_s: Annotated[float, Field(gt=0.0)] = 2.0
    feedback_flush_every: PositiveInt = 100


# Sections that configure the orchestration around the stages rather than a stage.
EXTRA_SECTIONS: dict[str, type[StageConfig]] = {"reprune": RepruneConfig, "serve": ServeConfig}

C = TypeVar("C", bound=StageConfig)


def read_params(path: str | Path) -> dict[str, Any]:
    """Reads a params file as a mapping of sections.

    Raises:
        ConfigError: The file is missing, not YAML, or not a mapping.
    """
    path = Path(path)
    try:
        data = yaml.safe_load(path.read_text())
    except FileNotFoundError:
        raise ConfigError(f"{path}: params file not found") from None
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML ({str(exc).splitlines()[0]})") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"{path}: must be a mapping of stage sections")
    return data


def _describe(section: str, error: dict[str, Any], cls: type[StageConfig]) -> str:
    loc = ".".join(str(p) for p in error["loc"])
    key = f"{section}.{loc}" if loc else section
    if error["type"] == "extra_forbidden":
        return f"{key}: unknown key; allowed keys: {', '.join(cls.model_fields)}"
    msg = error["msg"].replace("Input should be", "must be").replace("Value error, ", "")
    return f"{key}: {msg} (got {error.get('input')!r})"


def parse_section(section: str, raw: Any, cls: type[C]) -> C:
    """Validates one section of params into its config model.

    Raises:
        ConfigError: One line naming the first bad key and what is allowed.
    """
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(f"{section}: must be a mapping of keys, got {type(raw).__name__}")
    try:
        return cls.model_validate(raw)
    except ValidationError as exc:
        errors = exc.errors()
        more = f" (+{len(errors) - 1} more)" if len(errors) > 1 else ""
        raise ConfigError(_describe(section, errors[0], cls) + more) from None


def load_stage_config(params: dict[str, Any], stage: str) -> StageConfig:
    """Returns the validated config of `stage` from a params mapping."""
    try:
        cls = STAGE_CONFIGS[stage]
    except KeyError:
        raise ConfigError(f"unknown stage {stage!r}; stages: {', '.join(STAGE_CONFIGS)}") from None
    return parse_section(stage, params.get(stage), cls)


def check_sections(params: dict[str, Any]) -> None:
    """Rejects top-level sections that name no stage (a typo would otherwise be ignored)."""
    known = {**STAGE_CONFIGS, **EXTRA_SECTIONS}
    unknown = sorted(set(params) - set(known))
    if unknown:
        raise ConfigError(f"{unknown[0]}: unknown section; sections are: {', '.join(known)}")
