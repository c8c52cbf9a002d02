"""The sections that configure what runs around the stages: re-pruning, serving, where sweeps compute."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, field_validator

from pruneops.config.base import StageConfig, Text, registered, task_keys


class RepruneConfig(StageConfig):
    """`reprune` (not a DVC stage): the promotion gate and drift trigger of the Prefect flows."""

    TASK_KEYS = task_keys(
        classification="accuracy_tolerance latency_slo_ms latency_repeats",
        causal_lm="perplexity_tolerance decode_slo_ms prefill_slo_ms zero_shot_tolerance",
    )

    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005
    latency_slo_ms: Annotated[float, Field(gt=0.0, le=1e6)] = 1.0
    drift_threshold: Annotated[float, Field(gt=0.0, le=1e6)] = 0.2
    drift_check_cron: Annotated[str, Field(pattern=r"^\s*([0-9*/,\-]+\s+){4}[0-9*/,\-]+\s*$")] = "*/15 * * * *"
    drift_source: Text = "http://127.0.0.1:9090"
    registry_dir: Text = "models"
    feedback_dir: Text = "data/feedback"
    latency_repeats: Annotated[int, Field(ge=1, le=1_000_000)] = 200
    # Decoder LLMs: the most held-out perplexity a candidate may add (relative to production's), and
    # the time per output token and to the first token it must meet (each null: no slower than
    # production, timed interleaved).
    perplexity_tolerance: Annotated[float, Field(ge=0.0, le=100.0)] = 0.02
    decode_slo_ms: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    prefill_slo_ms: Annotated[float, Field(gt=0.0, le=1e6)] | None = None
    # Decoder LLMs with `validate.zero_shot`: the most accuracy points a candidate may lose against
    # production on the check's reported half, at the far end of the paired 95 % interval (null: not judged).
    zero_shot_tolerance: Annotated[float, Field(ge=0.0, le=100.0)] | None = 3.0


class ServeConfig(StageConfig):
    """`serve` (not a DVC stage): the serving app's drift window, thresholds and feedback store."""

    drift_window: Annotated[int, Field(ge=10, le=1_000_000)] = 1000
    drift_min_samples: Annotated[int, Field(ge=1, le=1_000_000)] | None = None
    psi_threshold: Annotated[float, Field(gt=0.0, le=1e6)] = 0.2
    ks_threshold: Annotated[float, Field(gt=0.0, le=1.0)] = 0.3
    accuracy_window: Annotated[int, Field(ge=1, le=1_000_000)] = 500
    max_batch: Annotated[int, Field(ge=1, le=65_536)] = 256
    max_body_bytes: Annotated[int, Field(ge=1024, le=1 << 30)] = 8 * 1024 * 1024
    read_timeout_s: Annotated[float, Field(gt=0.0, le=3600.0)] = 10.0
    reload_interval_s: Annotated[float, Field(ge=0.05, le=3600.0)] = 2.0
    feedback_flush_every: Annotated[int, Field(ge=1, le=1_000_000)] = 100


class ComputeConfig(StageConfig):
    """`compute`: where the independent evaluations of sweeps and trials run (never the timing).

    The results do not depend on it (the same seeds, the same values in the same order; each Ray
    task reserves and runs on the stage's `threads`), so no stage reruns when it changes.
    """

    backend: str = "local"
    # ray: `host:port` of a running cluster (`ray start --head`); null starts an instance on this machine.
    address: Annotated[str, Field(pattern=r"^(ray://)?[A-Za-z0-9_.\-\[\]:]+:[0-9]{1,5}$")] | None = None
    local_cpus: Annotated[int, Field(ge=1, le=4096)] | None = None  # that instance's CPUs (null: all)
    # Custom Ray resources each task needs, e.g. {sweep: 1} for workers started with that label.
    resources: dict[Annotated[str, Field(min_length=1, max_length=100)], Annotated[float, Field(gt=0, le=1e6)]] = Field(
        default_factory=dict
    )
    max_retries: Annotated[int, Field(ge=0, le=100)] = 3  # a task whose worker dies runs again elsewhere
    # The Ray resource that marks the serving machine: the timed stages (latency, prune, quantize,
    # benchmark) then run whole on that node, holding all its CPUs. null: they run where `dvc repro` does.
    timing_resource: Annotated[str, Field(min_length=1, max_length=100)] | None = None

    @field_validator("backend")
    @classmethod
    def _known_backend(cls, v: str) -> str:
        return registered("pruneops.pipeline.compute:BACKENDS", v)
