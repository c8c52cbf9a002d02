"""The latency allocation: efficient widths, insensitive units first, shortlists, unreachable targets."""

from __future__ import annotations

import pytest

from pruneops.planning.allocation import allocate_ratios, chance_drop
from pruneops.planning.latency_allocation import _candidates, allocate_latency
from tests.planning.latency_cases import CNN_SWEEP, _sweep


def test_latency_allocation_meets_the_target_at_efficient_widths_cutting_insensitive_units_first(synthetic):
    latency, sizes = synthetic
    sensitive = "stages.1.conv1"
    sweep = _sweep(sizes, lambda n: [0.05, 0.2, 0.5] if n == sensitive else [0.0, 0.001, 0.002])
    dense = latency.predict({}, 1)
    result = allocate_latency(latency, sweep, 0.6 * dense, 1, 0.8, None)
    assert result.reached and result.predicted_ms <= 0.6 * dense
    assert result.predicted_ms == pytest.approx(latency.predict(result.widths, 1))
    for name, width in result.widths.items():
        assert width in latency.efficient_widths(name, 1)
    others = [r for n, r in result.ratios.items() if n != sensitive]
    assert result.ratios[sensitive] <= min(others)  # the sensitive unit gives the least


def test_units_at_chance_at_every_ratio_are_left_whole(synthetic):
    latency, sizes = synthetic
    dead = "stem.0"
    # Baseline 0.99, 10 classes: a drop of 0.89 is chance; this unit is there at every ratio.
    sweep = _sweep(sizes, lambda n: [0.89, 0.89, 0.89] if n == dead else [0.01, 0.02, 0.3])
    at_chance = chance_drop(0.99, 0.1, 300)
    result = allocate_latency(latency, sweep, 0.7 * latency.predict({}, 1), 1, 0.8, at_chance)
    assert dead not in result.widths
    # The other units alone cannot give 65% (capped at 75% each): the old rule then cut the dead
    # unit, every ratio of it looking equally bad past the first; now it is not cut at all.
    assert allocate_ratios(sweep["units"], sweep["weights"], 0.65, 0.75)[dead] > 0.0
    assert allocate_ratios(sweep["units"], sweep["weights"], 0.65, 0.75, at_chance)[dead] == 0.0


@pytest.mark.parametrize(
    "curve",
    [
        lambda n, i: [0.01 * (i + 1), 0.05 * (i + 1), 0.3, 0.4, 0.5],  # convex, units alike but for scale
        lambda n, i: [0.2, 0.21, 0.22, 0.3, 0.4] if i % 2 else [0.0, 0.1, 0.4, 0.5, 0.6],  # the first cut dearest
        lambda n, i: CNN_SWEEP[n],
    ],
    ids=["convex", "mixed", "measured"],
)
@pytest.mark.parametrize("keep", [0.75, 0.5, 0.25])
def test_latency_allocation_is_no_worse_than_the_uniform_cut_of_the_same_latency(synthetic, curve, keep):
    """On its own objective the allocation beats (or ties) every unit cut alike at the same latency."""
    latency, sizes = synthetic
    names = sorted(sizes)
    ratios = [0.25, 0.5, 0.75, 0.875, 0.9375]
    units = {n: {"ratios": ratios, "accuracy_drop": curve(n, names.index(n)), "size": s} for n, s in sizes.items()}
    sweep = {"units": units, "weights": dict.fromkeys(sizes, 1.0)}
    uniform = {n: min(w for w in latency.efficient_widths(n, 1) if w >= keep * s) for n, s in sizes.items()}
    options = _candidates(latency, sweep, 1, 0.94, None)
    uniform_drop = sum(dict(options[n])[w] for n, w in uniform.items())
    result = allocate_latency(latency, sweep, latency.predict(uniform, 1), 1, 0.94, None)
    assert result.reached
    assert result.summed_isolated_drop <= uniform_drop + 1e-9


@pytest.mark.parametrize("keep", [0.5, 0.25])
def test_a_shortlist_holds_distinct_feasible_plans_least_drop_first_and_the_best_uniform_cut(synthetic, keep):
    """What plan trials choose from: the allocation first, then the next-least summed drops, and
    always the uniform cut with the least summed drop that meets the target."""
    from pruneops.planning.latency_allocation import SHORTLIST_FLOOR, _uniform_plans

    latency, sizes = synthetic
    ratios = [0.25, 0.5, 0.75, 0.875, 0.9375]
    units = {n: {"ratios": ratios, "accuracy_drop": CNN_SWEEP[n], "size": s} for n, s in sizes.items()}
    sweep = {"units": units, "weights": dict.fromkeys(sizes, 1.0)}
    target = latency.predict({n: max(16, round(keep * s)) for n, s in sizes.items()}, 1)
    single = allocate_latency(latency, sweep, target, 1, 0.94, None)
    result = allocate_latency(latency, sweep, target, 1, 0.94, None, shortlist=4)
    assert len(single.options) == 1 and single.options[0].widths == result.options[0].widths
    # As many plans as there are, up to four: a longer list holds the same least-drop plans first.
    longer = allocate_latency(latency, sweep, target, 1, 0.94, None, shortlist=64)
    assert len(result.options) == min(4, len(longer.options))
    plain = [o.widths for o in result.options if not o.uniform]
    assert plain == [o.widths for o in longer.options if not o.uniform][: len(plain)]
    first = result.options[0]
    assert (first.summed_isolated_drop, first.predicted_ms) == (result.summed_isolated_drop, result.predicted_ms)
    assert all(o.predicted_ms <= target for o in result.options)
    assert all(o.predicted_ms >= SHORTLIST_FLOOR * target for o in result.options[1:])
    assert all(o.predicted_ms == pytest.approx(latency.predict(o.widths, 1)) for o in result.options)
    widths = [o.widths for o in result.options]
    assert all(w not in widths[:i] for i, w in enumerate(widths))
    # Least summed drop first, but for the uniform cut put last where it would not have made the list.
    drops = [o.summed_isolated_drop for o in result.options]
    assert drops[:-1] == sorted(drops[:-1]) and drops[0] == first.summed_isolated_drop
    # The best feasible uniform cut, found independently of the shortlist.
    options = _candidates(latency, sweep, 1, 0.94, None)
    uniform = [{n: options[n][i][0] for n, i in p.items()} for p in _uniform_plans(latency, options)]
    feasible = [u for u in uniform if SHORTLIST_FLOOR * target <= latency.predict(u, 1) <= target]
    best = min(sum(dict(options[n])[w] for n, w in u.items()) for u in feasible)
    listed = [o.summed_isolated_drop for o in result.options if o.uniform]
    assert listed and min(listed) <= best + 1e-9
    assert all(o.uniform == (o.widths in uniform) for o in result.options)


def test_an_unreachable_latency_target_stops_at_the_fastest_allocation(synthetic):
    latency, sizes = synthetic
    sweep = _sweep(sizes, lambda n: [0.01, 0.02, 0.03])
    result = allocate_latency(latency, sweep, 0.001, 1, 0.5, None)
    assert not result.reached
    assert all(r <= 0.5 + 1e-9 for r in result.ratios.values())
