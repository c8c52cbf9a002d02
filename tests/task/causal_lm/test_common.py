"""The plan loop both the prune stage and `bench-decoder` run: plans scored once, ranked, timed in a loop."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch

pytest.importorskip("transformers")

from pruneops.core.errors import ConfigError  # noqa: E402
from pruneops.models.language import block_losses  # noqa: E402
from pruneops.planning.decode_cost import DecodeCostModel, shape_of  # noqa: E402
from pruneops.pruning.decoder_cuts import calibrate  # noqa: E402
from pruneops.task.causal_lm.common import GENAI, PlanLoop, PlanSpace  # noqa: E402
from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402


class _InjectedTimes(PlanLoop):
    """A loop whose plans 'measure' their prediction plus a fixed slowdown (no export, no clock)."""

    slowdown_ms = 0.0

    def measure(self, shape):
        self.models[shape] = self.cut(shape)
        return self.cost.predict(shape_of(self.dense.config)), self.cost.predict(shape) + self.slowdown_ms


def _loop(loop_type=PlanLoop) -> PlanLoop:
    torch.manual_seed(0)
    dense = tiny_decoder("llama").eval()
    base = shape_of(dense.config)
    # dense predicted at 10 ms, 2 ms of it out of every cut's reach
    cost = DecodeCostModel(intercept_ms=2.0, slope_ms=8.0 / base.layer_weights, residual_ms=0.0)
    return loop_type(
        dense=dense,
        tokenizer=None,
        calibration=calibrate(dense, random_blocks(4)),
        search=random_blocks(3, seed=1).numpy(),
        cost=cost,
        space=PlanSpace(max_layers_dropped=2),
        dense_folder=Path("unused"),
        work=Path("unused"),
        prompt=np.zeros((1, 8), dtype=np.int64),
        new_tokens=4,
        rounds=1,
        threads=1,
        runtime=GENAI,
    )


def test_plans_are_ranked_by_search_perplexity_and_scored_once():
    loop = _loop()
    cuts = []
    cut = loop.cut
    loop.cut = lambda shape: cuts.append(shape) or cut(shape)
    ranked = loop.ranked(7.0)
    assert len(ranked) >= 2  # one plan per depth and KV-group count
    nll = [r["search_nll"] for r in ranked]
    assert nll == sorted(nll)
    for row in ranked:
        assert row["predicted_ms"] <= 7.0
        assert row["search_perplexity"] == pytest.approx(math.exp(row["search_nll"]))
        again = float(block_losses(cut(row["shape"]), loop.search).mean())
        assert again == pytest.approx(row["search_nll"], rel=1e-5)  # the score is the cut model's
    loop.ranked(7.0)
    assert len(cuts) == len(ranked)  # a second ranking at the same target cuts nothing again


def test_no_plan_under_the_floor_names_the_floor():
    with pytest.raises(ConfigError, match=r"take 1\.50 ms/token \(the cost model's floor is 2\.00 ms\)"):
        _loop().ranked(1.5)


def test_a_plan_that_measures_at_the_target_is_kept_in_one_round():
    loop = _loop(_InjectedTimes)
    rounds = loop.run(0.7, 7.0)
    assert len(rounds) == 1
    assert rounds[0].shape == loop.ranked(7.0)[0]["shape"]
    assert rounds[0].measured_ratio <= 0.7
    assert set(loop.models) == {rounds[0].shape}


def test_a_missed_target_plans_narrower_with_the_miss_scaled_in():
    loop = _loop(_InjectedTimes)
    loop.slowdown_ms = 2.0  # every plan measures 2 ms slower than predicted (each is predicted above 5 ms)
    rounds = loop.run(0.7, 7.0)
    assert len(rounds) >= 2
    first, second = rounds[0], rounds[1]
    assert first.measured_ratio > 0.7
    assert second.target_ms == pytest.approx(first.predicted_ms * 0.7 / first.measured_ratio)
    assert second.predicted_ms < first.predicted_ms


def test_a_baseline_no_shape_of_which_reaches_the_target_times_its_fastest_shape():
    loop = _loop(_InjectedTimes)
    with pytest.raises(ConfigError, match="no uniform shape"):  # our plan space: refused
        loop.run(0.1, 1.5)
    loop.space = PlanSpace(max_layers_dropped=2, baseline=True)
    rounds = loop.run(0.1, 1.5)  # the floor is 2 ms: nothing reaches 1.5
    fastest = min(loop.cost.predict(s) for s in loop._shapes(math.inf))
    assert len(rounds) == 1 and rounds[0].predicted_ms == pytest.approx(fastest)
    assert rounds[0].measured_ratio > 0.1  # timed, and missed: the prune record says so
