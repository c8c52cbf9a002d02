"""A decoder's timing where it serves, the same shape for every runtime: to the first token, per output token."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from pruneops.config.prune import DecoderMetric


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
