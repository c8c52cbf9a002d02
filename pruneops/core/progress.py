"""Progress of a long step: a bar on a terminal, and log lines with a rate and the time left everywhere.

Under DVC, a flow or `pruneops bench` there is no terminal, so the bar is off and the log lines are
what shows that a slow step is moving: one at most every `every_s` seconds and one at the end, e.g.
`scoring perplexity: 96/160 blocks (60%), 4.1 blocks/s, ~16 s left`.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Iterator
from typing import TypeVar

from tqdm.auto import tqdm

log = logging.getLogger("pruneops")
T = TypeVar("T")
LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"  # how `show_progress` writes a log line
_STEP_MARK = " INFO pruneops: "  # a progress line in that format (`log` is the `pruneops` logger itself)


def show_progress() -> None:
    """Shows the package's log lines (progress, one per training epoch) on stderr, in `LOG_FORMAT`.

    A long stage under DVC, a flow or `pruneops bench` (which relays them) then shows how far it is.
    """
    if not log.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter(LOG_FORMAT))
        log.addHandler(handler)
        log.setLevel(logging.INFO)


def progress_text(line: str) -> str | None:
    """The message of a progress line as `show_progress` wrote it (`scoring perplexity: ...`), else None."""
    return line.split(_STEP_MARK, 1)[1] if _STEP_MARK in line else None


class Progress:
    """Counts work done on a step of known size and reports it (use as a context manager).

    Args:
        desc: What the step does ("scoring perplexity").
        total: Units of work in the step.
        unit: What one unit is ("blocks").
        every_s: Seconds between log lines.
        clock: The time source (injected in tests).
    """

    def __init__(
        self, desc: str, total: int, unit: str, every_s: float = 10.0, clock: object = time.perf_counter
    ) -> None:
        self.desc, self.total, self.unit, self.every_s, self.clock = desc, max(int(total), 0), unit, every_s, clock
        self.done = 0
        self.started = self.last = clock()
        self.bar = tqdm(total=self.total, desc=desc, unit=unit, disable=None, leave=False)

    def update(self, n: int = 1) -> None:
        """Records `n` more units done; logs a line when `every_s` have passed since the last."""
        self.done += n
        self.bar.update(n)
        now = self.clock()
        if now - self.last >= self.every_s and self.done < self.total:
            self.last = now
            log.info(self.line(now))

    def line(self, now: float) -> str:
        """`desc: done/total unit (pct), rate unit/s, ~left s left` (or the total time once done)."""
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        share = f" ({self.done / self.total:.0%})" if self.total else ""
        head = f"{self.desc}: {self.done}/{self.total} {self.unit}{share}, {_rate(rate, self.unit)}"
        if self.done >= self.total:
            return f"{head}, done in {_duration(elapsed)}"
        left = (self.total - self.done) / rate if rate > 0 else float("inf")
        return f"{head}, ~{_duration(left)} left"

    def __enter__(self) -> Progress:
        return self

    def __exit__(self, *exc: object) -> None:
        self.bar.close()
        now = self.clock()
        if exc[0] is None and now - self.started >= self.every_s:  # a step that took a while says it is done
            log.info(self.line(now))


def progress(items: Iterable[T], desc: str, total: int, unit: str, every_s: float = 10.0) -> Iterator[T]:
    """Yields `items`, reporting one unit each (see `Progress`)."""
    with Progress(desc, total, unit, every_s) as counter:
        for item in items:
            yield item
            counter.update()


def _rate(rate: float, unit: str) -> str:
    return f"{rate:.3g} {unit}/s" if rate >= 1 or rate == 0 else f"{1 / rate:.3g} s per {unit.rstrip('s')}"


def _duration(seconds: float) -> str:
    if seconds == float("inf"):
        return "? s"
    if seconds < 120:
        return f"{seconds:.0f} s"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"
