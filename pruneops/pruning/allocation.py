"""Per-unit ratio allocation from sensitivity curves: meet the target at the least summed isolated drop."""

from __future__ import annotations


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
        Ratio per unit (0.0 for units left alone).
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
        position[best[1]] = best[2]
    return {name: points[name][position[name]][0] for name in points}
