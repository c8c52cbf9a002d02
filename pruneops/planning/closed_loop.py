"""The one closed loop: plans measured against their goal until one lands in the band, then one kept.

Both tasks run it with their own plan and measure steps injected: a classifier's latency target
(`pruneops.planning.loop.LatencyLoop`: the latency table's next plan, the measured gate, the band
0.95-1.01 of the target, a reach for budget left unspent, then a runoff) and a causal LM's
(`pruneops.planning.decode_cost.close_the_loop`: the best plan the cost model predicts at a goal
tightened by each miss, timed against dense, at or under the target, the last kept).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

P, R = TypeVar("P"), TypeVar("R")  # a plan, and what measuring it reads


@dataclass(frozen=True)
class LoopOptions:
    """How the closed loop stops and what it keeps.

    Args:
        band: A reading (the plan's time as a fraction of the goal) inside it ends the loop.
        retries: Plans measured after the first, at most.
        reach: A reading inside the band but under this leaves budget unspent: one wider plan is
            measured (None: never).
        keep: `least_pruned`: of the plans measured, the slowest within the band's top (else the
            fastest); `last`: the last one measured (each narrower than the one before).
    """

    band: tuple[float, float]
    retries: int
    reach: float | None = None
    keep: str = "least_pruned"


def close_loop(
    first: tuple[P, R],
    measure: Callable[[P], R],
    next_plan: Callable[[list[tuple[P, R]], bool], P | None],
    fraction: Callable[[R], float],
    options: LoopOptions,
) -> list[tuple[P, R]]:
    """Measures plans until one's reading lands in the band: every (plan, reading) measured, in order.

    The one closed loop both tasks run. `first` is a plan already measured; while the last reading
    is outside `options.band`, `next_plan(measured so far, up)` gives the next plan (`up`: the
    last read under the band, so a milder one is wanted) and `measure` reads it, at most
    `options.retries` times or until there is no next plan. A reading in the band but under
    `options.reach` is followed by one milder plan.
    """
    low, high = options.band
    tried = [first]
    for _ in range(options.retries):
        off = fraction(tried[-1][1])
        if low <= off <= high:
            break
        plan = next_plan(tried, off < low)
        if plan is None:
            break
        tried.append((plan, measure(plan)))
    if options.reach is not None and low <= fraction(tried[-1][1]) < options.reach:
        plan = next_plan(tried, True)
        if plan is not None:
            tried.append((plan, measure(plan)))
    return tried


def kept_index(readings: list[float], usable: list[bool], options: LoopOptions) -> int:
    """Which measured plan the loop keeps (`options.keep`), by each one's fraction of the goal."""
    if options.keep == "last":
        return len(readings) - 1
    within = [i for i, f in enumerate(readings) if f <= options.band[1] and usable[i]]
    return max(within, key=readings.__getitem__) if within else min(range(len(readings)), key=readings.__getitem__)
