"""The decoder studies' workload file (`studies/decoder-workload.yaml`): its model, corpus split and recovery.

The format `pruneops bench-decoder` read before a decoder's benchmark became `pruneops bench` over the
pipeline (benchmarks/llm.yaml); the studies under studies/decoder/ and studies/gpu/ were measured
with it and still read it.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Literal

import numpy as np
import torch
import yaml
from pydantic import BaseModel, ConfigDict, Field

from pruneops.core.errors import ConfigError
from pruneops.data.corpus import build_corpus, read_documents, read_labelled, to_blocks
from pruneops.training.recovery import RecoverySettings

log = logging.getLogger(__name__)


class ZeroShotConfig(BaseModel):
    """A labelled file scored by comparing the likelihood of each answer after a prompt."""

    model_config = ConfigDict(extra="forbid")
    path: str
    text_column: str = "text"
    label_column: str = "label"
    prompt: str = "{text}\nAnswer:"
    answers: dict[str, str]  # the file's label -> the word the model is asked to prefer
    samples: Annotated[int, Field(ge=10, le=100_000)] = 200
    seed: int = 0


class DecoderBenchConfig(BaseModel):
    """A decoder workload: the model, its text, the targets and how everything is measured."""

    model_config = ConfigDict(extra="forbid")
    workload: str
    bench: str = "llm"
    model: str
    corpus: str
    text_column: str = "text"
    out_of_domain: str | None = None
    zero_shot: ZeroShotConfig | None = None
    block_length: Annotated[int, Field(ge=16, le=8192)] = 256
    seed: int = 0
    calibration_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    search_blocks: Annotated[int, Field(ge=1, le=100_000)] = 12
    val_blocks: Annotated[int, Field(ge=1, le=100_000)] = 24
    test_blocks: Annotated[int, Field(ge=1, le=100_000)] = 64
    ood_blocks: Annotated[int, Field(ge=1, le=100_000)] = 32
    targets: Annotated[list[Annotated[float, Field(gt=0.0, lt=1.0)]], Field(min_length=1)] = [0.7]
    max_layers_dropped: Annotated[int, Field(ge=0, le=1000)] = 12
    depth_step: Annotated[int, Field(ge=1, le=1000)] = 2  # depth cuts searched: multiples of this
    kv_groups: list[Annotated[int, Field(ge=1, le=1024)]] | None = None  # KV-group counts searched; null: all
    perplexity_budget: Annotated[float, Field(gt=0.0, le=10.0)] = 0.15
    quantize_tolerance: Annotated[float, Field(ge=0.0, le=10.0)] = 0.05
    precisions: list[str] = ["int8", "int4"]
    # Distillation from the dense model after ours is cut (0: none); the cut-only model stays a row.
    recovery_tokens: Annotated[int, Field(ge=0, le=10**10)] = 0
    recovery_lr: Annotated[float, Field(gt=0.0, le=1.0)] = 1e-4
    recovery_batch_blocks: Annotated[int, Field(ge=1, le=1024)] = 4
    # KL to the dense model's weight; the rest is next-token loss on the corpus (1: distillation only).
    recovery_distill_weight: Annotated[float, Field(ge=0.0, le=1.0)] = 1.0
    # bf16: recovery's forward passes under autocast (weights and optimiser fp32), as finetune.compute_dtype.
    recovery_compute_dtype: Literal["fp32", "bf16"] = "fp32"
    # A rank: LoRA adapters alone train, merged after (finetune.lora_rank); null: every weight.
    recovery_lora_rank: Annotated[int, Field(ge=1, le=65536)] | None = None
    recovery_lora_alpha: Annotated[float, Field(gt=0.0, le=1e6)] = 16.0
    # Where recovery trains, as finetune.device: cpu, or cuda / cuda:N where torch sees one.
    recovery_device: Annotated[str, Field(pattern=r"^(cpu|cuda(:[0-9]{1,2})?)$")] = "cpu"
    # Output vocabulary sizes also tried on ours once recovered (quantize.decoder_vocabulary): rows of
    # each size in fp32 and every precision; ranked on the training text, the model run on `vocabulary_blocks` of it.
    vocabulary: list[Annotated[int, Field(ge=2, le=10_000_000)]] = []
    vocabulary_blocks: Annotated[int, Field(ge=1, le=100_000)] = 96
    vocabulary_tail_groups: Annotated[int, Field(ge=1, le=1_000_000)] = 256  # quantize.decoder_tail_groups
    prompt_length: Annotated[int, Field(ge=1, le=32_768)] = 256
    new_tokens: Annotated[int, Field(ge=2, le=4096)] = 32
    batches: list[Annotated[int, Field(ge=1, le=256)]] = [1, 8]
    rounds: Annotated[int, Field(ge=1, le=100)] = 3
    threads: Annotated[int, Field(ge=1, le=256)] = 1


def load_bench_config(path: Path) -> DecoderBenchConfig:
    """Reads and validates a decoder bench file.

    Raises:
        ConfigError: One line naming the bad key.
    """
    from pydantic import ValidationError

    try:
        return DecoderBenchConfig.model_validate(yaml.safe_load(Path(path).read_text()))
    except ValidationError as exc:
        first = exc.errors()[0]
        raise ConfigError(f"{path}: {'.'.join(map(str, first['loc']))}: {first['msg']}") from None


@dataclass
class _Data:
    train: np.ndarray
    val: np.ndarray
    test: np.ndarray
    search: np.ndarray
    calibration: torch.Tensor
    ood: np.ndarray | None
    zero_shot: list[tuple[str, str]]


def workload_data(config: DecoderBenchConfig, tokenizer: object) -> _Data:
    """The workload's blocks: train, validation (reported and plan search apart), test, out-of-domain."""
    splits = build_corpus(
        read_documents(config.corpus, config.text_column), tokenizer, config.block_length, seed=config.seed
    )
    ood = None
    if config.out_of_domain:
        ood = to_blocks(read_documents(config.out_of_domain, config.text_column), tokenizer, config.block_length)[0]
        ood = ood[: config.ood_blocks]
    examples: list[tuple[str, str]] = []
    if config.zero_shot:
        z = config.zero_shot
        rows = [(t, z.answers[y]) for t, y in read_labelled(z.path, z.text_column, z.label_column) if y in z.answers]
        order = np.random.default_rng(z.seed).permutation(len(rows))[: z.samples]
        examples = [rows[i] for i in order]
    log.info("corpus: %s documents, %s tokens", splits.documents, splits.tokens)
    return _Data(
        train=splits.train,
        val=splits.val[: config.val_blocks],
        test=splits.test[: config.test_blocks],
        search=splits.val[-config.search_blocks :],
        calibration=torch.as_tensor(splits.train[: config.calibration_blocks]),
        ood=ood,
        zero_shot=examples,
    )


def recovery_settings(config: DecoderBenchConfig) -> RecoverySettings:
    """The bench file's recovery of ours, as `recover_` takes it."""
    return RecoverySettings(
        max_tokens=config.recovery_tokens,
        batch_blocks=config.recovery_batch_blocks,
        lr=config.recovery_lr,
        distill_weight=config.recovery_distill_weight,
        seed=config.seed,
        compute_dtype=config.recovery_compute_dtype,
        device=config.recovery_device,
        lora_rank=config.recovery_lora_rank,
        lora_alpha=config.recovery_lora_alpha,
    )
