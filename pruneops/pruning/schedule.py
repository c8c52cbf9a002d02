"""Pruning schedules: pure functions from (steps) to the fraction of the target reached per step."""

from __future__ import annotations

from collections.abc import Callable

from pruneops.core.plugins import Registry

SCHEDULES: Registry[Callable[[int], list[float]]] = Registry("pruning schedule")


@SCHEDULES.register("cubic", "Zhu & Gupta (2017): fast early, gentle near the target")
def cubic_schedule(steps: int) -> list[float]:
    """Fraction of the target after each of `steps` steps: 1 - (1 - t/n)^3, t = 1..n."""
    return [1.0 - (1.0 - t / steps) ** 3 for t in range(1, steps + 1)]


@SCHEDULES.register("linear", "equal increments")
def linear_schedule(steps: int) -> list[float]:
    """Fraction of the target after each step: t/n."""
    return [t / steps for t in range(1, steps + 1)]


@SCHEDULES.register("oneshot", "the whole target in the first step")
def oneshot_schedule(steps: int) -> list[float]:
    """Prunes everything at once; later steps only fine-tune."""
    return [1.0] * steps
