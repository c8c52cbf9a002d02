"""Latency allocation: per-unit widths whose predicted milliseconds meet a target at the least summed accuracy drop."""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass

from pruneops.planning.allocation import cost_of
from pruneops.planning.latency_model import LatencyModel

SHORTLIST_FLOOR = 0.85  # of the target: the least an alternative plan on the shortlist may be predicted at


def informative_points(curve: dict, chance_drop: float | None) -> list[tuple[float, float]]:
    """A unit's measured (ratio, drop) points, (0, 0) first, with the drop made non-decreasing.

    Points whose accuracy fell to chance are left out: at chance every ratio looks alike, so they
    say nothing about how much of the unit can go (the allocator would otherwise cut deepest).
    """
    points, best = [(0.0, 0.0)], 0.0
    for ratio, drop in zip(curve["ratios"], cost_of(curve), strict=True):
        if chance_drop is not None and drop >= chance_drop:
            break
        best = max(best, drop)
        points.append((ratio, best))
    return points


def drop_at(points: list[tuple[float, float]], ratio: float) -> float | None:
    """Interpolated drop at `ratio`; None beyond the last informative point."""
    if ratio <= 0.0:
        return 0.0
    for (r0, d0), (r1, d1) in itertools.pairwise(points):
        if r0 <= ratio <= r1:
            return d0 if r1 == r0 else d0 + (d1 - d0) * (ratio - r0) / (r1 - r0)
    return None


@dataclass(frozen=True)
class LatencyAllocation:
    """Per-unit widths that meet a latency target, their predicted latency and summed isolated drop."""

    widths: dict[str, int]
    ratios: dict[str, float]
    target_ms: float
    batch: int
    predicted_ms: float
    dense_predicted_ms: float
    summed_isolated_drop: float
    steps: int
    reached: bool
    # The least-drop feasible plans, this one first (see `allocate_latency`'s `shortlist`).
    options: tuple[PlanOption, ...] = ()


@dataclass(frozen=True)
class PlanOption:
    """One feasible plan of a latency allocation: widths, predicted ms, summed isolated drop."""

    widths: dict[str, int]
    ratios: dict[str, float]
    predicted_ms: float
    summed_isolated_drop: float
    uniform: bool  # every unit cut alike


def _candidates(latency: LatencyModel, sweep: dict, batch: int, max_ratio: float, chance_drop: float | None):
    """Per unit: the efficient widths it may stop at, each with its interpolated isolated drop."""
    out: dict[str, list[tuple[int, float]]] = {}
    for name, unit in latency.units.items():
        curve = sweep["units"].get(name)
        if curve is None:
            continue
        points = informative_points(curve, chance_drop)
        options = []
        for width in latency.efficient_widths(name, batch):
            ratio = 1.0 - width / unit.size
            drop = drop_at(points, ratio)
            if ratio <= max_ratio + 1e-9 and drop is not None:
                options.append((width, drop))
        out[name] = sorted(options, reverse=True)  # widest first: where every unit starts
    return out


def _descend(latency: LatencyModel, options: dict, target_ms: float, batch: int, leap: bool) -> dict[str, int]:
    """Greedy NetAdapt-style descent: positions (option indices) from full width down to `target_ms`.

    Repeatedly moves the unit whose next efficient width (with `leap`, any narrower one) saves
    the most predicted milliseconds per point of isolated accuracy drop, predicting the whole
    model each time (the layers between two pruned units shrink in both dimensions, which
    per-unit sums would miss). Without `leap` it stops where no next width saves anything.
    """
    position = {n: 0 for n, opts in options.items() if opts}
    widths = {n: options[n][0][0] for n in position}
    current = latency.predict(widths, batch)
    while current > target_ms:
        best = None
        for name, i in position.items():
            # In context the next width may save nothing where a narrower one does.
            js = range(i + 1, len(options[name]) if leap else min(i + 2, len(options[name])))
            moved = latency.predict_moves(widths, name, [options[name][j][0] for j in js], batch)
            for j, ms in zip(js, moved, strict=True):
                drop = options[name][j][1]
                saved = current - ms
                if saved <= 0:
                    continue
                key = (max(drop - options[name][i][1], 0.0) / saved, -saved)
                if best is None or key < best[0]:
                    best = (key, name, j)
        if best is None:
            break
        _, name, j = best
        position[name] = j
        widths[name] = options[name][j][0]
        current = latency.predict(widths, batch)
    return position


def _lagrangian(latency: LatencyModel, options: dict, weight: float, batch: int) -> dict[str, int]:
    """Positions minimising `summed drop + weight * predicted ms` by coordinate descent.

    Unlike the descent, a unit may widen again when others narrow, so it escapes the early
    greedy moves that lock in: on a residual CNN the descent kept a 6-channel layer that a
    near-uniform plan of the same predicted latency avoids at two thirds of the summed drop.
    """
    position = {n: 0 for n, opts in options.items() if opts}
    for _ in range(20):
        changed = False
        for name in position:
            widths = {n: options[n][i][0] for n, i in position.items()}
            moved = latency.predict_moves(widths, name, [width for width, _ in options[name]], batch)
            costs = [drop + weight * ms for (_, drop), ms in zip(options[name], moved, strict=True)]
            best = min(range(len(costs)), key=costs.__getitem__)
            if costs[best] < costs[position[name]] - 1e-12:
                position[name], changed = best, True
        if not changed:
            break
    return position


def _plans_along_weights(latency: LatencyModel, options: dict, target_ms: float, batch: int, dense: float):
    """Lagrangian plans for weights bisected (log scale) towards the smallest one that meets the target."""
    low, high = math.log(1e-4 / dense), math.log(1e4 / dense)
    for _ in range(24):
        middle = (low + high) / 2
        position = _lagrangian(latency, options, math.exp(middle), batch)
        if latency.predict({n: options[n][i][0] for n, i in position.items()}, batch) <= target_ms:
            high = middle
            yield position
        else:
            low = middle


def _uniform_plans(latency: LatencyModel, options: dict):
    """Every unit cut alike: for each kept fraction some unit can stop at, each unit's narrowest option keeping it."""
    sizes = {n: latency.units[n].size for n in options if options[n]}
    for fraction in sorted({w / sizes[n] for n in sizes for w, _ in options[n]}):
        # Options run widest first: the last one still keeping the fraction is the narrowest.
        yield {n: max(i for i, (w, _) in enumerate(options[n]) if w >= fraction * s) for n, s in sizes.items()}


def allocate_latency(
    latency: LatencyModel,
    sweep: dict,
    target_ms: float,
    batch: int,
    max_ratio: float,
    chance_drop: float | None,
    shortlist: int = 1,
) -> LatencyAllocation:
    """Widths meeting `target_ms` (predicted at `batch`) with the least summed isolated accuracy drop.

    Searches over the table's efficient widths, the best kept: the greedy descent step by step
    and leaping (`_descend`), Lagrangian coordinate descent (`_lagrangian`) with its weight
    bisected to the target, and every unit cut alike (`_uniform_plans`); no one of them is best
    on every model (docs/explanation/latency-targets.md#allocators). Where no allocation the
    sweep's informative ratios and `max_ratio` allow reaches the target, the fastest plan found
    is kept (`reached` False).

    With `shortlist` above 1, `options` holds up to that many distinct feasible plans predicted
    at `SHORTLIST_FLOOR` of the target or more, least summed drop first (the allocation itself,
    wherever it lands), and the best such uniform one among them: at deep cuts the summed drop (no
    fine-tuning) ranks plans against what fine-tuning recovers, so the caller may rank the
    shortlist by training instead (`pruneops.task.classification.prune`'s plan trials).
    """
    options = _candidates(latency, sweep, batch, max_ratio, chance_drop)
    dense = latency.predict({}, batch)

    def widths_of(position: dict[str, int]) -> dict[str, int]:
        return {n: options[n][i][0] for n, i in position.items()}

    def summed_drop(position: dict[str, int]) -> float:
        return sum(options[n][i][1] for n, i in position.items())

    plans = [_descend(latency, options, target_ms, batch, leap) for leap in (False, True)]
    plans += list(_plans_along_weights(latency, options, target_ms, batch, dense))
    first_uniform = len(plans)
    plans += list(_uniform_plans(latency, options))  # so that the allocation is never worse than uniform
    predicted = [latency.predict(widths_of(p), batch) for p in plans]
    uniform = [widths_of(p) for p in plans[first_uniform:]]
    # Least summed drop first; ties: the first found.
    feasible = sorted((i for i, ms in enumerate(predicted) if ms <= target_ms), key=lambda i: summed_drop(plans[i]))
    # Beside the least-drop plan, only plans near the target: one far under it is cut deeper than asked.
    near = feasible[:1] + [i for i in feasible[1:] if predicted[i] >= SHORTLIST_FLOOR * target_ms]
    picks = _shortlisted([widths_of(plans[i]) for i in near], uniform, shortlist)
    picks = [near[k] for k in picks] or [min(range(len(plans)), key=predicted.__getitem__)]

    def option(i: int) -> PlanOption:
        widths = widths_of(plans[i])
        ratios = {n: 1.0 - w / latency.units[n].size for n, w in widths.items()}
        return PlanOption(widths, ratios, predicted[i], summed_drop(plans[i]), widths in uniform)

    options = tuple(option(i) for i in picks)
    best = options[0]
    return LatencyAllocation(
        widths={n: w for n, w in best.widths.items() if w < latency.units[n].size},
        ratios=best.ratios,
        target_ms=target_ms,
        batch=batch,
        predicted_ms=best.predicted_ms,
        dense_predicted_ms=dense,
        summed_isolated_drop=best.summed_isolated_drop,
        steps=sum(plans[picks[0]].values()),
        reached=best.predicted_ms <= target_ms,
        options=options,
    )


def _shortlisted(ordered: list[dict[str, int]], uniform: list[dict[str, int]], count: int) -> list[int]:
    """Indices of the first `count` distinct plans of `ordered`, the first uniform one among them."""
    distinct: list[int] = []
    for i, widths in enumerate(ordered):
        if all(widths != ordered[j] for j in distinct):
            distinct.append(i)
    picks = distinct[:count]
    first_uniform = next((i for i in distinct if ordered[i] in uniform), None)
    if count > 1 and first_uniform is not None and first_uniform not in picks:
        picks[-1] = first_uniform
    return picks
