"""`runtimes.onnxruntime.timing.measure_latencies`: interleaved turns, each timed run warm, optionally time-boxed."""

from __future__ import annotations

import time

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.runtimes.onnxruntime.timing import MIN_TURNS, SELF_WARMING_RUN_S, measure_latencies


class _Recorder:
    """A stand-in ONNX Runtime session that logs which model ran, in order."""

    def __init__(self, name: str, log: list[str]) -> None:
        self.name, self.log = name, log

    def run(self, _outputs, feed: dict) -> None:
        self.log.append(f"{self.name}:{len(next(iter(feed.values())))}")


def test_each_timed_run_follows_an_untimed_run_of_the_same_model_and_turns_rotate():
    log: list[str] = []
    sessions = {n: _Recorder(n, log) for n in ("a", "b", "c")}
    config = BenchmarkConfig(batch_sizes=[1, 4], warmup=2, repeats=3, rounds=2)
    samples = measure_latencies(sessions, np.zeros((4, 2), dtype=np.float32), config)
    turns = config.rounds * config.repeats
    for batch in (1, 4):
        assert {n: s[batch].shape for n, s in samples.items()} == dict.fromkeys("abc", (turns,))
    runs = log[2 * 3 :]  # after batch 1's warm-up (2 runs of each of 3 models)
    first_batch = runs[: 2 * 3 * turns]
    # Pairs: a model runs twice in a row (untimed, then timed) and the next pair is another model,
    # so the timed run finds its own weights in cache whatever ran before it.
    pairs = [first_batch[i : i + 2] for i in range(0, len(first_batch), 2)]
    assert all(p[0] == p[1] for p in pairs)
    assert all(a[0] != b[0] for a, b in zip(pairs, pairs[1:], strict=False))
    # Each turn starts with another model: drift falls on every model alike.
    starts = [pairs[3 * t][0] for t in range(turns)]
    assert starts[:3] == ["a:1", "b:1", "c:1"]
    assert len(log) == 2 * (3 * 2 + 2 * 3 * turns)  # per batch size: warm-up, then two runs a turn


class _Sleeper:
    """A stand-in session whose every run takes at least `seconds`."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def run(self, _outputs, _feed: dict) -> None:
        time.sleep(self.seconds)


def test_a_time_budget_caps_the_turns_from_the_warm_up_runs_but_keeps_a_floor():
    sessions = {n: _Sleeper(0.005) for n in ("a", "b")}
    config = BenchmarkConfig(batch_sizes=[1], warmup=1, repeats=10, rounds=2)
    x = np.zeros((1, 2), dtype=np.float32)
    assert measure_latencies(sessions, x, config)["a"][1].shape == (20,)
    # A turn costs >= 2 models x 2 runs x 5 ms = 20 ms, so 0.1 s buys at most 5 turns: the floor wins.
    assert measure_latencies(sessions, x, config, budget_s=0.1)["a"][1].shape == (MIN_TURNS,)
    assert measure_latencies(sessions, x, config, budget_s=100.0)["a"][1].shape == (20,)


def test_a_run_long_enough_to_warm_itself_is_timed_without_an_untimed_run_before_it():
    log: list[str] = []

    class _Slow(_Recorder):
        def run(self, outputs, feed: dict) -> None:
            super().run(outputs, feed)
            time.sleep(SELF_WARMING_RUN_S)

    sessions = {"fast": _Recorder("fast", log), "slow": _Slow("slow", log)}
    config = BenchmarkConfig(batch_sizes=[1], warmup=1, repeats=3, rounds=1)
    measure_latencies(sessions, np.zeros((1, 2), dtype=np.float32), config)
    timed = log[2:]
    assert timed.count("fast:1") == 2 * 3 and timed.count("slow:1") == 3
