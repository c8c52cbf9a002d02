"""The decoder server's scheduler on a model whose steps take a known time (no runtime: the decisions alone)."""

from __future__ import annotations

import threading
import time

import pytest

from pruneops.serving.scheduler import Finished, Job, QueueFull, Scheduler

STEP_S = 0.002


class _Generation:
    def __init__(self, model, prompt, max_length):
        self.model, self.left, self.done, self.next = model, max_length - len(prompt), False, 100

    def step(self) -> int:
        time.sleep(self.model.step_s)
        if self.model.fail_on is not None and self.next == self.model.fail_on:
            raise RuntimeError("the runtime failed")
        self.left -= 1
        self.done = self.left <= 0
        self.next += 1
        return self.next - 1


class _Model:
    """Each step sleeps `step_s` and yields 100, 101, ...; a job ends at its length."""

    def __init__(self, max_concurrent=4, step_s=STEP_S, fail_on=None):
        self.max_concurrent, self.step_s, self.fail_on, self.started = max_concurrent, step_s, fail_on, 0

    def start(self, prompt, max_length, sampling):
        self.started += 1
        return _Generation(self, prompt, max_length)


class _Sink:
    def __init__(self):
        self.tokens, self.finished, self.first = [], None, threading.Event()
        self.done = threading.Event()

    def token(self, t):
        self.tokens.append(t)
        self.first.set()

    def end(self, finished: Finished):
        self.finished = finished
        self.done.set()


def _job(sink: _Sink, new_tokens: int, deadline_s: float = 60.0) -> Job:
    return Job([1, 2, 3], new_tokens, None, time.monotonic() + deadline_s, sink.token, sink.end)


def test_a_job_runs_to_its_length_and_is_timed():
    scheduler = Scheduler(_Model())
    sink = _Sink()
    scheduler.submit(_job(sink, 5))
    assert sink.done.wait(5)
    f = sink.finished
    assert f.tokens == sink.tokens == [100, 101, 102, 103, 104] and f.reason == "length"
    assert f.first_s >= STEP_S and len(f.steps_s) == 4 and min(f.steps_s) >= STEP_S
    scheduler.stop()


def test_twenty_clients_that_hang_up_after_one_token_do_not_delay_the_next_request():
    scheduler = Scheduler(_Model(max_concurrent=8))
    left = [_Sink() for _ in range(20)]
    jobs = [_job(s, 4000) for s in left]  # unchecked, 20 x 4000 steps of 2 ms: 160 s of work
    for job in jobs:
        scheduler.submit(job)
    for job, sink in zip(jobs, left, strict=True):
        assert sink.first.wait(10)
        job.cancel()  # the client hung up after its first token
    start = time.monotonic()
    sink = _Sink()
    scheduler.submit(_job(sink, 4))
    assert sink.done.wait(10)
    assert time.monotonic() - start < 1.0
    for job_sink in left:
        assert job_sink.done.wait(5) and job_sink.finished.reason == "cancelled"
        # Generation stops within a token of the hang-up: at most one step of each turn ran after it.
        assert len(job_sink.finished.tokens) <= 1 + 20
    assert sum(len(s.finished.tokens) for s in left) < 20 * 25
    scheduler.stop()


def test_a_full_queue_refuses_with_a_retry_after_and_a_waiting_job_starts_when_a_slot_frees():
    scheduler = Scheduler(_Model(max_concurrent=1), max_waiting=2)
    sinks = [_Sink() for _ in range(3)]
    scheduler.submit(_job(sinks[0], 50))
    assert sinks[0].first.wait(5)  # running: the next two wait
    scheduler.submit(_job(sinks[1], 50))
    scheduler.submit(_job(sinks[2], 50))
    assert scheduler.load() == (1, 2)
    with pytest.raises(QueueFull) as refused:
        scheduler.submit(_job(_Sink(), 50))
    assert refused.value.retry_after_s >= 1 and "2 requests are waiting" in str(refused.value)
    for sink in sinks:
        assert sink.done.wait(10) and sink.finished.reason == "length"
    assert sinks[2].finished.waited_s >= 2 * 50 * STEP_S  # it waited for both before it
    scheduler.stop()


def test_a_job_past_its_deadline_ends_there_and_a_failing_job_ends_alone():
    scheduler = Scheduler(_Model(step_s=0.01))
    late = _Sink()
    scheduler.submit(_job(late, 1000, deadline_s=0.1))
    assert late.done.wait(5) and late.finished.reason == "deadline"
    assert 3 <= len(late.finished.tokens) <= 12  # about 10 steps of 10 ms fit in 0.1 s
    scheduler.use(_Model(fail_on=103))
    failing, fine = _Sink(), _Sink()
    scheduler.submit(_job(failing, 10))
    assert failing.done.wait(5)
    assert failing.finished.reason == "error" and "runtime failed" in failing.finished.error
    assert failing.finished.tokens == [100, 101, 102]
    scheduler.use(_Model())
    scheduler.submit(_job(fine, 3))
    assert fine.done.wait(5) and fine.finished.reason == "length"  # the worker went on
    scheduler.stop()


def test_running_jobs_take_turns_a_token_each():
    scheduler = Scheduler(_Model(max_concurrent=4))
    order: list[int] = []
    sinks = []
    for i in range(3):
        sink = _Sink()
        sink.token = lambda t, i=i, s=sink: (order.append(i), s.tokens.append(t))
        sinks.append(sink)
    with scheduler._wake:  # held: all three are admitted in the same turn
        for sink in sinks:
            scheduler._waiting.append(_job(sink, 4))
        scheduler._wake.notify()
    for sink in sinks:
        assert sink.done.wait(5)
    assert order == [0, 1, 2] * 4
    scheduler.stop()
