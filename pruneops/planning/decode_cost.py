"""How much of a decoder LLM to cut for a decode-time target: shapes, a fitted cost, feasible plans.

A `DecoderShape` is what a config expresses: layer count, MLP width, KV groups and query heads
per group. Decoding one token at batch 1 reads every weight once, so its time is close to linear
in the weights a token touches; `DecodeCostModel` fits `time = intercept + slope * layer_weights`
(least squares, intercept at least 0) on shapes timed on this machine. The intercept holds what no
layer cut touches: the tied output projection over the vocabulary, the embedding and the runtime's
per-step overhead.
`feasible_plans` lists, for each depth and KV-group count, the widest MLP whose predicted time
meets a target: the candidates whose quality is then measured.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, replace

import numpy as np

from pruneops.core.errors import ConfigError
from pruneops.models.decoder_layout import mlp_matrices
from pruneops.planning.closed_loop import LoopOptions, close_loop


@dataclass(frozen=True)
class DecoderShape:
    """A uniform decoder shape (every layer alike: what a config expresses)."""

    layers: int
    mlp_width: int
    kv_groups: int
    queries_per_group: int
    hidden: int
    head_dim: int
    vocab: int
    mlp_projections: int = 3  # gate, up, down (2 for GPT-2 and GPT-NeoX)

    @property
    def attention_weights(self) -> int:
        """Weights of one layer's q, k, v and o projections."""
        q = self.kv_groups * self.queries_per_group * self.head_dim
        kv = self.kv_groups * self.head_dim
        return self.hidden * (2 * q + 2 * kv)

    @property
    def mlp_weights(self) -> int:
        """Weights of one layer's MLP."""
        return self.mlp_projections * self.hidden * self.mlp_width

    @property
    def layer_weights(self) -> int:
        """Weights every generated token reads in the decoder layers."""
        return self.layers * (self.attention_weights + self.mlp_weights)

    @property
    def output_weights(self) -> int:
        """Weights of the output projection over the vocabulary (no layer cut reduces it)."""
        return self.hidden * self.vocab

    def describe(self) -> str:
        """`24 layers, MLP 1024, 3x3 heads`."""
        return f"{self.layers} layers, MLP {self.mlp_width}, {self.kv_groups}x{self.queries_per_group} heads"


def shape_of(config: object) -> DecoderShape:
    """The shape a HuggingFace config describes (Llama-style keys; GPT-2's and GPT-NeoX's too).

    Its MLP matrices per neuron are read from the layout the config builds (`mlp_matrices`): 3
    for a gated MLP, 2 for a plain one (GPT-2, GPT-NeoX, Phi, Nemotron).
    """
    hidden = getattr(config, "hidden_size", None) or config.n_embd
    heads = getattr(config, "num_attention_heads", None) or config.n_head
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or hidden // heads
    layers = getattr(config, "num_hidden_layers", None) or config.n_layer
    width = getattr(config, "intermediate_size", None) or getattr(config, "n_inner", None) or 4 * hidden
    projections = mlp_matrices(config)
    return DecoderShape(layers, width, kv, heads // kv, hidden, head_dim, config.vocab_size, projections)


@dataclass(frozen=True)
class DecodeCostModel:
    """Decode time per token as `intercept + slope * layer_weights`, fitted on timed shapes."""

    intercept_ms: float
    slope_ms: float  # per decoder-layer weight
    residual_ms: float  # root mean square residual of the fit

    def predict(self, shape: DecoderShape) -> float:
        """Predicted milliseconds per generated token."""
        return self.intercept_ms + self.slope_ms * shape.layer_weights

    def untouchable_share(self, dense: DecoderShape) -> float:
        """The share of the dense model's decode time that no layer cut can remove."""
        return self.intercept_ms / self.predict(dense)


def fit_cost_model(timed: Iterable[tuple[DecoderShape, float]]) -> DecodeCostModel:
    """Least-squares fit on (shape, measured ms per token) pairs, the intercept held at 0 or above.

    Noisy timings of a small model can tilt the free line below the origin, which would predict
    negative times for deep cuts; the constrained fit never does.

    Raises:
        ConfigError: Fewer than two distinct shapes, or a fit that predicts time growing as weights fall.
    """
    pairs = list(timed)
    x = np.array([s.layer_weights for s, _ in pairs], dtype=float)
    y = np.array([t for _, t in pairs], dtype=float)
    if len(set(x.tolist())) < 2:
        raise ConfigError("decode cost model: needs at least two timed shapes of different sizes")
    design = np.stack([np.ones_like(x), x], axis=1)
    (intercept, slope), *_ = np.linalg.lstsq(design, y, rcond=None)
    if intercept < 0:
        # A step costs something however few weights it reads: the best fit with the intercept
        # held at its bound, 0, is the least-squares line through the origin.
        intercept, slope = 0.0, float(x @ y / (x @ x))
    if slope <= 0:
        raise ConfigError(
            f"decode cost model: time does not fall with the weights cut (slope {slope:.3g} ms per weight); "
            "the timings are noise at this size: time more tokens or rounds"
        )
    residual = float(np.sqrt(np.mean((design @ np.array([intercept, slope]) - y) ** 2)))
    return DecodeCostModel(float(intercept), float(slope), residual)


def width_step(width: int) -> int:
    """MLP widths are kept multiples of 64 (SIMD- and cache-friendly kernels); 8 on toy-sized models."""
    return 64 if width >= 512 else 8


def feasible_plans(
    dense: DecoderShape,
    model: DecodeCostModel,
    target_ms: float,
    max_layers_dropped: int,
    kv_group_options: Iterable[int],
    round_to: int | None = None,
    min_width_fraction: float = 0.125,
    depth_step: int = 1,
) -> list[DecoderShape]:
    """The widest MLP for each depth and KV-group count whose predicted decode time meets `target_ms`.

    Args:
        dense: The unpruned shape.
        model: The fitted decode cost.
        target_ms: Predicted milliseconds per token to meet.
        max_layers_dropped: Deepest depth cut considered (every count from 0 to it).
        kv_group_options: KV-group counts considered (each at the dense queries per group).
        round_to: MLP widths are multiples of this (default `width_step` of the dense width).
        min_width_fraction: Narrowest MLP considered, as a fraction of the dense width.
        depth_step: Depth cuts considered are multiples of this.

    Returns:
        Plans sorted by predicted time (slowest, i.e. least cut, first); empty when none meets it.
    """
    plans = []
    round_to = round_to or width_step(dense.mlp_width)
    floor = max(round_to, int(dense.mlp_width * min_width_fraction) // round_to * round_to)
    for dropped in range(0, max_layers_dropped + 1, depth_step):
        for groups in kv_group_options:
            base = replace(dense, layers=dense.layers - dropped, kv_groups=groups)
            if base.layers < 1:
                continue
            width = dense.mlp_width if model.predict(base) <= target_ms else None
            if width is None:
                width = _widest_meeting(base, model, target_ms, round_to, floor)
            if width is not None:
                plans.append(replace(base, mlp_width=width))
    return sorted(set(plans), key=model.predict, reverse=True)


def _widest_meeting(base: DecoderShape, model: DecodeCostModel, target_ms: float, step: int, floor: int) -> int | None:
    width = (base.mlp_width - 1) // step * step
    while width >= floor:
        if model.predict(replace(base, mlp_width=width)) <= target_ms:
            return width
        width -= step
    return None


LOOP_ROUNDS = 3  # plan-and-measure rounds before a missed target is reported as missed


@dataclass(frozen=True)
class LoopRound:
    """One round of the closed loop: the target planned for, the plan kept, both measured."""

    target_ms: float  # in the cost model's units: what the plan was predicted to meet
    shape: DecoderShape
    predicted_ms: float
    dense_ms: float
    measured_ms: float

    @property
    def measured_ratio(self) -> float:
        """The plan's measured time as a fraction of dense's, timed interleaved."""
        return self.measured_ms / self.dense_ms

    def record(self) -> dict:
        """The round as JSON: its fields, the shape described, the measured ratio."""
        return {**asdict(self), "shape": self.shape.describe(), "measured_ratio": self.measured_ratio}


# A causal LM's loop: a plan at or under the target ends it; each miss tightens the goal; the last is kept.
DECODER_LOOP = LoopOptions((0.0, 1.0), LOOP_ROUNDS - 1, keep="last")


def close_the_loop(
    plan: Callable[[float], DecoderShape],
    measure: Callable[[DecoderShape], tuple[float, float]],
    model: DecodeCostModel,
    target_ratio: float,
    target_ms: float,
    rounds: int = LOOP_ROUNDS,
) -> list[LoopRound]:
    """Plans for a predicted time, measures the plan against dense, and plans again while it misses.

    The cost model is fitted once, on a machine whose speed drifts, so a plan predicted to meet
    the target can measure slower. After a miss the next round's target is the plan's own
    prediction scaled by the miss (`target_ratio / measured ratio`): a narrower plan, chosen again
    by quality. The loop stops at the first plan measured at the target, when a tighter target
    has no plan, or after `rounds` (`pruneops.planning.closed_loop.close_loop`, `DECODER_LOOP`).

    Args:
        plan: The best plan (by quality) predicted to take at most the given milliseconds.
        measure: (dense ms, plan ms) of a shape, timed interleaved.
        model: The cost model the plans are predicted by.
        target_ratio: The target as a fraction of dense's measured time.
        target_ms: The first round's target in the cost model's units.
        rounds: At most this many plans are measured.

    Returns:
        The rounds, in order; the last one's plan is the one to keep.

    Raises:
        ConfigError: The first round has no plan (later rounds without one end the loop).
    """
    aims = {}

    def measured(shape: DecoderShape) -> LoopRound:
        dense_ms, measured_ms = measure(shape)
        return LoopRound(aims[shape], shape, model.predict(shape), dense_ms, measured_ms)

    def next_plan(so_far: list[tuple[DecoderShape, LoopRound]], up: bool) -> DecoderShape | None:
        last = so_far[-1][1]
        aim = last.predicted_ms * target_ratio / last.measured_ratio
        try:
            shape = plan(aim)
        except ConfigError:
            return None
        aims[shape] = aim
        return shape

    first = plan(target_ms)  # a first round without a plan is an error
    aims[first] = target_ms
    options = replace(DECODER_LOOP, retries=rounds - 1)
    history = close_loop((first, measured(first)), measured, next_plan, lambda r: r.measured_ratio / target_ratio,
                         options)  # fmt: skip
    return [reading for _, reading in history]
