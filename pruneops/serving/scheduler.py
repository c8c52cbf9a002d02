"""The decoder server's scheduler: a bounded queue and one worker that steps every running generation in turn.

Requests no longer wait behind one lock for a whole generation. Each is a `Job`; `submit` queues
it (or refuses it with `QueueFull` when `max_waiting` jobs already wait, which the app answers
429 with `Retry-After`). One worker thread admits up to the model's `max_concurrent` jobs and
advances each running job by one token per turn, so a short request that arrives behind long ones
gets its first token after at most one step of each, and a job whose client left (`Job.cancel`,
set by the app on a disconnect or a stop string) or whose deadline passed ends within a token.
A model that batches (`step_batch`, e.g. `pruneops.runtimes.genai.batch.BatchDecoder`) advances
all its running jobs in one call per turn: new ones prefilled alone, the others decoded together.
The model runtimes' generators are only ever touched by the worker. Every job ends with one
`Finished` passed to its `on_end` (an error ends it too, with `error` set).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

log = logging.getLogger(__name__)

FinishReason = Literal["eos", "length", "cancelled", "deadline", "error"]


class QueueFull(Exception):
    """`max_waiting` jobs already wait; `retry_after_s` is when one slot is expected to free."""

    def __init__(self, waiting: int, retry_after_s: int):
        super().__init__(f"the server is busy: {waiting} requests are waiting; retry in {retry_after_s} s")
        self.retry_after_s = retry_after_s


@dataclass
class Finished:
    """How a job ended: its tokens, why it ended, and its timings (seconds)."""

    tokens: list[int]
    reason: FinishReason
    first_s: float | None  # prefill and the first token (None: no token was generated)
    steps_s: list[float]  # each further token
    waited_s: float  # in the queue before its prefill began
    error: str | None = None


@dataclass(eq=False)
class Job:
    """One generation: its prompt ids, bounds and sampling, and where its tokens and its end go.

    `on_token` and `on_end` are called from the worker thread (the app passes thread-safe ones).
    """

    prompt: list[int]
    max_new_tokens: int
    sampling: Mapping[str, Any] | None
    deadline: float  # time.monotonic() after which the job ends (reason `deadline`)
    on_token: Callable[[int], None]
    on_end: Callable[[Finished], None]
    submitted: float = field(default_factory=time.monotonic)
    _cancelled: threading.Event = field(default_factory=threading.Event)

    def cancel(self) -> None:
        """Ends the job before its next token (a client that left, a stop string reached)."""
        self._cancelled.set()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


@dataclass(eq=False)
class _Running:
    job: Job
    generation: Any
    started: float
    model: Any  # the model it started on (a promotion does not move it)
    tokens: list[int] = field(default_factory=list)
    first_s: float | None = None
    steps_s: list[float] = field(default_factory=list)
    error: str | None = None


class Scheduler:
    """A bounded queue of jobs and the worker that runs them, stepping each running job a token per turn.

    Args:
        model: The loaded model whose generators run the jobs (`start`, `max_concurrent`); replace
            it with `use` (a promotion): running jobs finish on the model they started on.
        max_waiting: Jobs that may wait beyond those running; one more is refused (`QueueFull`).
    """

    def __init__(self, model: Any, max_waiting: int = 32):
        self._model = model
        self.max_waiting = max_waiting
        self._waiting: deque[Job] = deque()
        self._running: list[_Running] = []
        self._wake = threading.Condition()
        self._step_s = 0.05  # a running estimate of one turn's step (Retry-After)
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="decoder-scheduler", daemon=True)
        self._thread.start()

    def use(self, model: Any) -> None:
        """Starts jobs on `model` from now on."""
        with self._wake:
            self._model = model

    def submit(self, job: Job) -> None:
        """Queues a job.

        Raises:
            QueueFull: `max_waiting` jobs already wait.
        """
        with self._wake:
            if len(self._waiting) >= self.max_waiting:
                tokens = sum(j.max_new_tokens for j in self._waiting) / max(1, self._model.max_concurrent)
                raise QueueFull(len(self._waiting), max(1, round(tokens * self._step_s)))
            self._waiting.append(job)
            self._wake.notify()

    def load(self) -> tuple[int, int]:
        """(running, waiting) jobs now."""
        with self._wake:
            return len(self._running), len(self._waiting)

    def stop(self) -> None:
        """Ends the worker after its current step (jobs left are ended as cancelled)."""
        with self._wake:
            self._stopped = True
            self._wake.notify()
        self._thread.join(timeout=10)

    def _admit(self) -> bool:
        """Moves waiting jobs into the running set while there is room; False once stopped."""
        with self._wake:
            while not self._running and not self._waiting and not self._stopped:
                self._wake.wait()
            if self._stopped:
                for job in [*self._waiting, *(r.job for r in self._running)]:
                    _safely(job.on_end, Finished([], "cancelled", None, [], 0.0))
                return False
            model = self._model
            while self._waiting and len(self._running) < model.max_concurrent:
                job = self._waiting.popleft()
                started = time.monotonic()
                try:
                    generation = model.start(job.prompt, len(job.prompt) + job.max_new_tokens, job.sampling)
                except Exception as exc:  # noqa: BLE001 - the job ends with the runtime's error, the worker goes on
                    _safely(job.on_end, Finished([], "error", None, [], started - job.submitted, str(exc)[:300]))
                    continue
                self._running.append(_Running(job, generation, started, model))
        return True

    def _work(self) -> None:
        while self._admit():
            turn = time.perf_counter()
            live = self._live()
            for model in {id(r.model): r.model for r in live}.values():
                runs = [r for r in live if r.model is model]
                if hasattr(model, "step_batch"):  # one batched step for all its running jobs
                    self._step_together(model, runs)
                else:
                    for run in runs:
                        self._step(run)
            if self._running:
                self._step_s = 0.8 * self._step_s + 0.2 * (time.perf_counter() - turn) / len(self._running)

    def _live(self) -> list[_Running]:
        """The running jobs that go on this turn; those cancelled or past their deadline end here."""
        live = []
        for run in list(self._running):
            if run.job.cancelled:
                self._end(run, "cancelled")
            elif time.monotonic() > run.job.deadline:
                self._end(run, "deadline")
            else:
                live.append(run)
        return live

    def _end(self, run: _Running, reason: FinishReason) -> None:
        self._running.remove(run)
        waited = run.started - run.job.submitted
        _safely(run.job.on_end, Finished(run.tokens, reason, run.first_s, run.steps_s, waited, run.error))

    def _failed(self, runs: list[_Running], exc: Exception) -> None:
        log.error("generation failed: %s", str(exc)[:300])
        for run in runs:
            run.error = str(exc)[:300]
            self._end(run, "error")

    def _step(self, run: _Running) -> None:
        """One token of one running job (a model that steps its sequences one at a time)."""
        tick = time.perf_counter()
        try:
            token = run.generation.step()
        except Exception as exc:  # noqa: BLE001 - this job ends with the error; the others run on
            self._failed([run], exc)
            return
        self._took(run, token, time.perf_counter() - tick)

    def _step_together(self, model: Any, runs: list[_Running]) -> None:
        """One token of every running job of a batching model: new ones prefilled, the others in one batch."""
        tick = time.perf_counter()
        try:
            tokens = model.step_batch([r.generation for r in runs])
        except Exception as exc:  # noqa: BLE001 - the batch's jobs end with the error; the worker goes on
            self._failed(runs, exc)
            return
        elapsed = time.perf_counter() - tick
        for run, token in zip(runs, tokens, strict=True):
            if token is not None:  # None: a new sequence the model reads in a later step
                self._took(run, token, elapsed)

    def _took(self, run: _Running, token: int, elapsed: float) -> None:
        """Records a job's token: its time, its client's piece, and its end where it ends.

        The first token's time runs from the job's admission: the turns it waited for and its prefill.
        """
        if run.first_s is None:
            run.first_s = time.monotonic() - run.started
        else:
            run.steps_s.append(elapsed)
        run.tokens.append(token)
        _safely(run.job.on_token, token)
        if run.generation.done:
            self._end(run, "length" if len(run.tokens) >= run.job.max_new_tokens else "eos")


def _safely(call: Callable[[Any], None], value: Any) -> None:
    """Hands a job's token or end to the app; a failure there (its client gone) never stops the worker."""
    try:
        call(value)
    except Exception as exc:  # noqa: BLE001 - logged; the worker serves the other jobs
        log.warning("a job's callback failed: %s", str(exc)[:300])
