"""Progress lines: a rate and the time left, at most every `every_s`, and a last line once a long step is done."""

from __future__ import annotations

import logging

from pruneops.core.progress import Progress


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_a_long_step_logs_its_rate_and_the_time_left_then_that_it_is_done(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="pruneops"), Progress("scoring", 100, "blocks", 10.0, clock) as p:
        for _ in range(100):
            clock.now += 0.5  # 2 blocks/s: 50 s in all
            p.update()
    lines = [r.getMessage() for r in caplog.records]
    # Every 10 s of 50: at 10, 20, 30, 40 s, then the closing line (none at 50 s: the step is done).
    assert len(lines) == 5
    assert lines[0] == "scoring: 20/100 blocks (20%), 2 blocks/s, ~40 s left"
    assert lines[-1] == "scoring: 100/100 blocks (100%), 2 blocks/s, done in 50 s"


def test_a_quick_step_says_nothing_and_a_slow_unit_reads_as_seconds_per_unit(caplog):
    clock = Clock()
    with caplog.at_level(logging.INFO, logger="pruneops"):
        with Progress("export", 3, "precisions", 10.0, clock) as p:
            clock.now = 1.0
            p.update()
        assert caplog.records == []
        with Progress("export", 3, "precisions", 10.0, clock) as p:
            clock.now += 40.0
            p.update()
    assert caplog.records[0].getMessage() == "export: 1/3 precisions (33%), 40 s per precision, ~80 s left"


def test_the_bench_reads_back_a_progress_line_as_show_progress_writes_it(monkeypatch):
    """`pruneops bench` relays a stage's progress from its log: the writer's format and the reader agree."""
    import io

    from pruneops.core.progress import log, progress_text, show_progress

    monkeypatch.setattr(log, "handlers", [])  # as in a fresh stage process (restored afterwards)
    monkeypatch.setattr(log, "level", log.level)
    stream = io.StringIO()
    monkeypatch.setattr("sys.stderr", stream)
    show_progress()
    clock = Clock()
    with Progress("scoring", 2, "blocks", 10.0, clock) as p:
        clock.now = 30.0
        p.update(2)
    logging.getLogger("pruneops.training.fit").info("epoch 1/3")  # a module's line: not a progress line
    first, second = stream.getvalue().splitlines()
    assert progress_text(first) == "scoring: 2/2 blocks (100%), 15 s per block, done in 30 s"
    assert progress_text(second) is None
