"""Per-unit ratio allocation from sensitivity curves: meet the target at the least summed isolated drop."""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass

from pruneops.core.errors import ConfigError


def _monotone(values: list[float]) -> list[float]:
    """Running maximum, clamped at 0: removing more never helps (noise aside)."""
    out, best = [], 0.0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def cost_of(curve: dict) -> list[float]:
    """What the allocation minimises for a unit at each ratio of its curve.

    The accuracy drop the sweep measured (`sensitivity.estimator: evaluate`), else the loss
    increase it predicted without evaluating (`fisher`).
    """
    return curve["accuracy_drop"] if "accuracy_drop" in curve else curve["predicted_loss_increase"]


def chance_drop(baseline: float, chance: float, samples: int) -> float:
    """The accuracy drop at which a pruned model is no better than guessing (3 standard errors above chance)."""
    return baseline - chance - 3.0 * (max(chance * (1.0 - chance), 1e-6) / max(samples, 1)) ** 0.5


def informative(curve: dict, at_chance: float | None) -> int:
    """How many of a curve's measured points are above chance (they come first: drops only grow)."""
    drops = _monotone(cost_of(curve))
    return len(drops) if at_chance is None else sum(1 for d in drops if d < at_chance)


def allocate_ratios(
    curves: dict[str, dict], sizes: dict[str, float], target: float, max_ratio: float, at_chance: float | None = None
) -> dict[str, float]:
    """Chooses a removal ratio per unit from its measured curve.

    The constraint is on the weighted mean ratio (sum w*ratio >= target * sum w, with w the
    unit's cost, e.g. MACs saved per removed fraction);
    the objective is the summed accuracy drop each unit showed when pruned alone. Greedy on the best marginal cost per
    removed unit, which is optimal for convex curves and a good approximation otherwise.

    Args:
        curves: Per unit `{"ratios": [...], "accuracy_drop": [...], "loss_increase": [...]}`,
            ratios ascending and effective (what was really removed); a Fisher sweep's curves
            carry `predicted_loss_increase` instead of the two measured lists (see `cost_of`).
        sizes: Per unit, its weight in the constraint (channel count, or MAC cost).
        target: Global fraction to remove, in [0, 1).
        max_ratio: No unit loses more than this fraction.
        at_chance: The drop at which accuracy is at chance (`chance_drop`). Points at or beyond it
            are left out: every ratio at chance looks alike, so a unit would otherwise be cut to
            its deepest ratio as soon as it is cut at all.

    Returns:
        Ratio per unit (0.0 for units left alone): measured ratios, except that the unit moved
        last stops between two of them where the target is met exactly.
    """
    points: dict[str, list[tuple[float, float]]] = {}
    for name, c in curves.items():
        drops = _monotone(cost_of(c))
        loss = _monotone(c.get("loss_increase", [0.0] * len(drops)))
        keep = informative(c, at_chance)
        # The loss term only breaks ties between equal accuracy drops.
        pts = [(0.0, 0.0)] + [
            (r, d + 1e-3 * lo)
            for r, d, lo in list(zip(c["ratios"], drops, loss, strict=True))[:keep]
            if 0 < r <= max_ratio
        ]
        points[name] = pts
    position = {name: 0 for name in points}
    total = sum(sizes[n] for n in points)
    need = target * total

    def removed() -> float:
        return sum(sizes[n] * points[n][position[n]][0] for n in points)

    last = None
    while removed() + 1e-9 < need:
        best = None
        for name, pts in points.items():
            r0, d0 = pts[position[name]]
            for j in range(position[name] + 1, len(pts)):
                r1, d1 = pts[j]
                gain = sizes[name] * (r1 - r0)
                if gain <= 0:
                    continue
                key = ((d1 - d0) / gain, -gain)
                if best is None or key < best[0]:
                    best = (key, name, j)
        if best is None:
            break
        last = (best[1], position[best[1]])
        position[best[1]] = best[2]
    ratios = {name: points[name][position[name]][0] for name in points}
    if last is not None and removed() > need + 1e-9:
        # The last move overshoots the target: that unit takes only what is still needed, between
        # the two measured ratios, so the achieved ratio (and the MACs) follow the target smoothly.
        name, before = last
        short = need - (removed() - sizes[name] * ratios[name])
        ratios[name] = max(points[name][before][0], short / sizes[name])
    return ratios


def achieved_ratio(ratios: dict[str, float], sizes: dict[str, float]) -> float:
    """The weighted mean ratio an allocation removes (the quantity `target` constrains)."""
    return sum(sizes[n] * r for n, r in ratios.items()) / max(sum(sizes.values()), 1)


def interpolated_drop(curve: dict, ratio: float) -> float:
    """The accuracy drop a unit showed alone at `ratio`, linear between measured ratios."""
    pts = [(0.0, 0.0)] + list(zip(curve["ratios"], _monotone(cost_of(curve)), strict=True))
    for (r0, d0), (r1, d1) in itertools.pairwise(pts):
        if r0 <= ratio <= r1:
            return d0 if r1 == r0 else d0 + (d1 - d0) * (ratio - r0) / (r1 - r0)
    return pts[-1][1]


@dataclass(frozen=True)
class Allocation:
    """Per-unit ratios for a target, what they reach and what they cost on the sweep."""

    ratios: dict[str, float]
    target_ratio: float
    achieved_ratio: float
    summed_isolated_drop: float
    max_unit_ratio: float


def allocate_for_target(sweep: dict, target: float, max_ratio: float) -> Allocation:
    """Allocates per-unit ratios from a sensitivity sweep (`sensitivity.json`) for `target`.

    Raises:
        ConfigError: The sweep cannot reach the target under the per-unit cap.
    """
    curves, weights = sweep["units"], sweep["weights"]
    ratios = allocate_ratios(curves, weights, target, max_ratio, sweep.get("chance_drop"))
    achieved = achieved_ratio(ratios, weights)
    if achieved + 1e-9 < target:
        top = max((max(c["ratios"], default=0.0) for c in curves.values()), default=0.0)
        raise ConfigError(
            f"prune.target.value: ratio {target} is out of reach of the sweep (at most {achieved:.3f} with "
            f"sensitivity.ratios up to {top} and prune.max_unit_ratio {max_ratio}); add higher "
            "sensitivity.ratios, raise prune.max_unit_ratio or lower the target"
        )
    cost = sum(interpolated_drop(curves[name], r) for name, r in ratios.items())
    return Allocation(ratios, target, achieved, cost, max_ratio)


def ratio_for_budget(
    size_at: Callable[[float], float], budget: float, high: float = 0.98, iterations: int = 14
) -> float:
    """The smallest ratio in [0, `high`] whose pruned size is within `budget` (bisection).

    Args:
        size_at: Pruned size (MACs, params...) at a ratio; raises `ConfigError` for a ratio out of
            reach (the answer, if any, then lies below it).
        budget: The largest size allowed.
        high: The largest ratio tried.
        iterations: Bisection steps (14 resolve the ratio to about 1e-4).

    Raises:
        ConfigError: No reachable ratio meets the budget.
    """
    if size_at(0.0) <= budget:
        return 0.0
    low, found = 0.0, None
    for _ in range(iterations):
        mid = (low + high) / 2
        try:
            fits = size_at(mid) <= budget
        except ConfigError:
            high = mid
            continue
        if fits:
            high, found = mid, mid
        else:
            low = mid
    if found is None:
        raise ConfigError(
            f"prune.target.value: {budget:,.0f} is out of reach (no ratio up to {high:.3f} the sweep and "
            "prune.max_unit_ratio allow gets there); raise max_unit_ratio, add higher sensitivity.ratios "
            "or ask for less"
        )
    return round(found, 5)
