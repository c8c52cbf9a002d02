"""A decoder's timing where it serves, the same shape for every runtime: to the first token, per output token."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

import numpy as np

from pruneops.core.errors import PruneOpsError

if TYPE_CHECKING:
    from pruneops.config.prune import DecoderMetric
    from pruneops.runtimes.base import Runtime


@dataclass(frozen=True)
class DecodeWorkload:
    """What a decoder is timed on: one prompt (batch, prompt length) of token ids, then `new_tokens` greedy steps.

    Each of `rounds` rounds runs one generation of every model in turn (after `warmup` untimed ones).
    """

    prompt: np.ndarray
    new_tokens: int
    rounds: int
    warmup: int = 1


@dataclass(frozen=True)
class GenerationTiming:
    """Medians over rounds (milliseconds) of one model at one batch size."""

    ttft_ms: float
    tpot_ms: float
    tpot_rounds_ms: tuple[float, ...]
    prompt_length: int
    new_tokens: int
    batch: int

    @property
    def tokens_per_second(self) -> float:
        """Generated tokens per second per sequence at steady decode."""
        return 1000.0 / self.tpot_ms

    def milliseconds(self, metric: DecoderMetric) -> float:
        """The time a latency target names: per output token (`decode`) or to the first token (`prefill`)."""
        return self.tpot_ms if metric == "decode" else self.ttft_ms


class TimedGenerator(Protocol):
    """An opened model of any runtime that can run one timed greedy generation."""

    def generate_timed(self, prompt: np.ndarray, new_tokens: int) -> tuple[float, list[float], np.ndarray]:
        """(time to first token in s, each further step's time in s, the (batch, new_tokens) tokens)."""


def time_interleaved(models: dict[str, TimedGenerator], workload: DecodeWorkload) -> dict[str, GenerationTiming]:
    """Times every model interleaved, of one runtime or several: per round, one generation of each in turn.

    After `workload.warmup` untimed short generations of each, every round runs each model once;
    the medians are over rounds (per-step times are first reduced to a median within the run), so
    machine drift falls on every model alike.
    """
    prompt = np.ascontiguousarray(workload.prompt, dtype=np.int32)
    for model in models.values():
        for _ in range(workload.warmup):
            model.generate_timed(prompt, min(workload.new_tokens, 4))
    firsts: dict[str, list[float]] = {name: [] for name in models}
    steps: dict[str, list[float]] = {name: [] for name in models}
    for _ in range(workload.rounds):
        for name, model in models.items():
            first, step, _ = model.generate_timed(prompt, workload.new_tokens)
            firsts[name].append(first)
            steps[name].append(float(np.median(step)) if step else float("nan"))
    return {
        name: GenerationTiming(
            ttft_ms=1000 * float(np.median(firsts[name])),
            tpot_ms=1000 * float(np.median(steps[name])),
            tpot_rounds_ms=tuple(1000 * s for s in steps[name]),
            prompt_length=prompt.shape[1],
            new_tokens=workload.new_tokens,
            batch=prompt.shape[0],
        )
        for name in models
    }


def time_together(
    artefacts: Mapping[str, tuple[Runtime, Path]], workload: DecodeWorkload
) -> dict[str, GenerationTiming]:
    """Exports of one runtime or several, timed interleaved in this process (each in its own runtime).

    Raises:
        PruneOpsError: A runtime times fewer sequences at once than the workload's prompt has rows.
    """
    batch = workload.prompt.shape[0]
    for runtime, _ in artefacts.values():
        if runtime.max_batch is not None and batch > runtime.max_batch:
            raise PruneOpsError(f"{runtime.name} runtime: times at most {runtime.max_batch} sequence(s), asked {batch}")
    runtimes = {runtime.name: runtime for runtime, _ in artefacts.values()}
    if len(runtimes) == 1:  # the runtime's own timing
        (runtime,) = runtimes.values()
        return runtime.time({name: path for name, (_, path) in artefacts.items()}, workload)
    return time_interleaved({name: runtime.timer(path) for name, (runtime, path) in artefacts.items()}, workload)
