"""Per-unit ratio allocation from sensitivity curves: meet the target at the least summed isolated drop."""

from __future__ import annotations

import itertools


def _monotone(values: list[float]) -> list[float]:
    """Running maximum, clamped at 0: removing more never helps (noise aside)."""
    out, best = [], 0.0
    for v in values:
        best = max(best, v)
        out.append(best)
    return out


def allocate_ratios(
    curves: dict[str, dict], sizes: dict[str, float], target: float, max_ratio: float
) -> dict[str, float]:
    """Chooses a removal ratio per unit from its measured curve.

    The constraint is on the weighted mean ratio (sum w*ratio >= target * sum w, with w the
    unit's cost, e.g. MACs saved per removed fraction);
    the objective is the summed accuracy drop each unit showed when pruned alone. Greedy on the best marginal cost per
    removed unit, which is optimal for convex curves and a good approximation otherwise.

    Args:
        curves: Per unit `{"ratios": [...], "accuracy_drop": [...], "loss_increase": [...]}`,
            ratios ascending and effective (what was really removed).
        sizes: Per unit, its weight in the constraint (channel count, or MAC cost).
        target: Global fraction to remove, in [0, 1).
        max_ratio: No unit loses more than this fraction.

    Returns:
        Ratio per unit (0.0 for units left alone): measured ratios, except that the unit moved
        last stops between two of them where the target is met exactly.
    """
    points: dict[str, list[tuple[float, float]]] = {}
    for name, c in curves.items():
        drops = _monotone(c["accuracy_drop"])
        loss = _monotone(c.get("loss_increase", [0.0] * len(drops)))
        # The loss term only breaks ties between equal accuracy drops.
        pts = [(0.0, 0.0)] + [
            (r, d + 1e-3 * lo) for r, d, lo in zip(c["ratios"], drops, loss, strict=True) if 0 < r <= max_ratio
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
    pts = [(0.0, 0.0)] + list(zip(curve["ratios"], _monotone(curve["accuracy_drop"]), strict=True))
    for (r0, d0), (r1, d1) in itertools.pairwise(pts):
        if r0 <= ratio <= r1:
            return d0 if r1 == r0 else d0 + (d1 - d0) * (ratio - r0) / (r1 - r0)
    return pts[-1][1]
