"""Decode-time planning: shapes from configs, the fitted cost, the widest feasible plans, the closed loop."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from pruneops.core.errors import ConfigError
from pruneops.planning.decode_cost import (
    LOOP_ROUNDS,
    DecodeCostModel,
    DecoderShape,
    close_the_loop,
    feasible_plans,
    fit_cost_model,
    shape_of,
    width_step,
)

SMOL = DecoderShape(layers=30, mlp_width=1536, kv_groups=3, queries_per_group=3, hidden=576, head_dim=64, vocab=49152)


def test_weights_per_token_of_a_smollm2_shape():
    # q and o: 576 x 576 each; k and v: 576 x 192 each; MLP: 3 x 576 x 1536
    assert SMOL.attention_weights == 576 * (2 * 576 + 2 * 192)
    assert SMOL.mlp_weights == 3 * 576 * 1536
    assert SMOL.layer_weights == 30 * (SMOL.attention_weights + SMOL.mlp_weights)
    share = SMOL.output_weights / (SMOL.output_weights + SMOL.layer_weights)
    assert share == pytest.approx(0.21, abs=0.01)  # the tied output layer: ~21 % of what a token reads


def test_a_linear_cost_is_recovered_exactly_and_predicts_unseen_shapes():
    def truth(shape):
        return 4.0 + 3e-7 * shape.layer_weights

    timed = [(s, truth(s)) for s in (SMOL, replace(SMOL, layers=18), replace(SMOL, mlp_width=768))]
    model = fit_cost_model(timed)
    assert model.intercept_ms == pytest.approx(4.0) and model.slope_ms == pytest.approx(3e-7)
    assert model.residual_ms == pytest.approx(0.0, abs=1e-9)
    unseen = replace(SMOL, layers=24, mlp_width=1024, kv_groups=2)
    assert model.predict(unseen) == pytest.approx(truth(unseen))
    assert model.untouchable_share(SMOL) == pytest.approx(4.0 / truth(SMOL))


def test_timings_that_tilt_the_line_below_the_origin_fit_with_the_intercept_at_zero():
    # Three shapes whose free line crosses zero above 0 weights: the fit is held at the origin.
    shapes = [SMOL, replace(SMOL, layers=20), replace(SMOL, layers=10)]
    timed = [(s, 1e-6 * s.layer_weights - 2.0 + noise) for s, noise in zip(shapes, (0.1, -0.2, 0.1), strict=True)]
    model = fit_cost_model(timed)
    x = np.array([s.layer_weights for s in shapes], dtype=float)
    y = np.array([t for _, t in timed])
    assert model.intercept_ms == 0.0 and model.slope_ms == pytest.approx(float(x @ y / (x @ x)))
    assert model.predict(replace(SMOL, layers=1)) > 0 and model.untouchable_share(SMOL) == 0.0
    free = np.polyfit(x, y, 1)  # the unconstrained line, for contrast, is below zero at the origin
    assert free[1] < 0 and model.residual_ms >= np.sqrt(np.mean((np.polyval(free, x) - y) ** 2))


def test_noise_that_inverts_the_cost_is_refused():
    with pytest.raises(ConfigError, match="does not fall"):
        fit_cost_model([(SMOL, 30.0), (replace(SMOL, layers=10), 31.0)])
    with pytest.raises(ConfigError, match="two timed shapes"):
        fit_cost_model([(SMOL, 30.0), (SMOL, 31.0)])


def test_feasible_plans_are_the_widest_meeting_the_target_at_each_depth():
    model = fit_cost_model(
        [(SMOL, 4.0 + 3e-7 * SMOL.layer_weights), (replace(SMOL, layers=10), 4.0 + 1e-7 * SMOL.layer_weights)]
    )
    target = 0.7 * model.predict(SMOL)
    plans = feasible_plans(SMOL, model, target, max_layers_dropped=12, kv_group_options=[3, 2], depth_step=2)
    assert plans and all(model.predict(p) <= target for p in plans)
    assert all(p.mlp_width % width_step(SMOL.mlp_width) == 0 for p in plans)
    for plan in plans:  # one step wider misses the target (unless already at the dense width)
        if plan.mlp_width < SMOL.mlp_width:
            assert model.predict(replace(plan, mlp_width=plan.mlp_width + 64)) > target
    assert {SMOL.layers - p.layers for p in plans} <= set(range(0, 13, 2))
    assert feasible_plans(SMOL, model, 1.0, 0, [3]) == []  # nothing is that fast


def test_shape_of_reads_every_family_config():
    from tests.decoder_helpers import FAMILIES, tiny_decoder

    for family in FAMILIES:
        shape = shape_of(tiny_decoder(family).config)
        assert shape.layers == 4 and shape.mlp_width == 48, family
        assert shape.mlp_projections == (2 if family in ("gpt2", "gpt_neox") else 3)


@pytest.mark.parametrize(
    ("family", "matrices"),
    [("phi", 2), ("nemotron", 2), ("starcoder2", 2), ("phi3", 3), ("qwen3", 3), ("gemma3_text", 3)],
)
def test_a_plain_mlp_holds_two_matrices_a_neuron_and_a_gated_or_fused_one_three(family, matrices):
    from tests.decoder_helpers import family_decoder

    model = family_decoder(family, layers=2)
    assert shape_of(model.config).mlp_projections == matrices
    weights = sum(p.numel() for p in model.model.layers[0].mlp.parameters() if p.dim() == 2)
    assert weights == matrices * 128 * 96  # hidden 128, MLP width 96: what the cost model counts


# The cost model the loop plans by, and the machine it measures on: `untouched_ms` more per token than the fit
# holds, which no layer cut removes (the machine's overhead grew after the fit), so a plan predicted to meet a
# target measures slower, as a fraction of dense, than predicted.
FITTED = DecodeCostModel(intercept_ms=6.0, slope_ms=3e-7, residual_ms=0.0)


def _machine(untouched_ms: float):
    def true(s: DecoderShape) -> float:
        return untouched_ms + FITTED.predict(s)

    def measure(shape: DecoderShape) -> tuple[float, float]:
        return true(SMOL), true(shape)

    return measure


def _widest_full_depth(target_ms: float) -> DecoderShape:
    plans = feasible_plans(SMOL, FITTED, target_ms, 0, [3])
    if not plans:
        raise ConfigError("no plan")
    return plans[0]


def test_a_plan_measured_at_the_target_is_kept_in_one_round():
    rounds = close_the_loop(_widest_full_depth, _machine(0.0), FITTED, 0.64, 0.64 * FITTED.predict(SMOL))
    assert len(rounds) == 1 and rounds[0].measured_ratio <= 0.64


def test_a_missed_target_is_planned_again_narrower_until_measured():
    measure = _machine(3.0)
    rounds = close_the_loop(_widest_full_depth, measure, FITTED, 0.64, 0.64 * FITTED.predict(SMOL))
    assert rounds[0].measured_ratio > 0.64  # the fit under-predicts: the first plan misses
    assert 1 < len(rounds) <= LOOP_ROUNDS and rounds[-1].measured_ratio <= 0.64
    for before, after in zip(rounds, rounds[1:], strict=False):  # each round: a tighter target, a narrower plan
        assert after.target_ms == pytest.approx(before.predicted_ms * 0.64 / before.measured_ratio)
        assert after.shape.mlp_width < before.shape.mlp_width and after.predicted_ms <= after.target_ms


def test_a_loop_that_cannot_reach_the_target_stops_and_says_what_it_measured():
    # 30 ms no cut removes: half of dense is out of reach at full depth
    rounds = close_the_loop(_widest_full_depth, _machine(30.0), FITTED, 0.5, 0.5 * FITTED.predict(SMOL))
    assert rounds and all(r.measured_ratio > 0.5 for r in rounds) and len(rounds) <= LOOP_ROUNDS
    with pytest.raises(ConfigError, match="no plan"):
        close_the_loop(_widest_full_depth, _machine(0.0), FITTED, 0.01, 0.01 * FITTED.predict(SMOL))
