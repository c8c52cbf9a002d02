"""Interleaved ONNX Runtime timing: sessions run turn by turn so machine drift falls on every model alike."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.core.errors import ConfigError
from pruneops.core.inputs import as_feed, timing_inputs

if TYPE_CHECKING:
    from torch import nn


def _repeat(x: np.ndarray, size: int) -> np.ndarray:
    reps = -(-size // len(x))
    return np.ascontiguousarray(np.concatenate([x] * reps)[:size])


def _batch(x: np.ndarray | dict[str, np.ndarray], size: int) -> dict[str, np.ndarray]:
    """A feed of `size` samples: `x` repeated as needed (plain or named inputs)."""
    if isinstance(x, dict):
        return {k: _repeat(v, size) for k, v in x.items()}
    return as_feed(_repeat(x, size))


MIN_TURNS = 10  # fewest timed runs per model under a time budget: a median still means something

SELF_WARMING_RUN_S = 0.02  # a run at least this long is timed without an untimed run before it


def measure_latencies(
    sessions: dict, x: np.ndarray, config: BenchmarkConfig, budget_s: float | None = None
) -> dict[str, dict[int, np.ndarray]]:
    """Latency samples (ms) per model and batch size, `rounds * repeats` each, interleaved run by run.

    Each turn times every model once, the order rotating from turn to turn, so that machine drift
    (clock frequency, other load) falls on every model alike: identical models measured this way
    agree to about 0.5% here, where blocks of runs per model disagreed by up to 20% at 50 µs.

    Args:
        sessions: ONNX Runtime sessions by name.
        x: One sample (plain or named inputs), repeated to each batch size.
        config: Batch sizes, warm-up, repeats and rounds.
        budget_s: At most about this many seconds of timed turns per batch size (at least
            `MIN_TURNS` turns), judged from the warm-up runs: for gates inside a stage, where a
            transformer's large batch (MiniLM: ~0.4 s a run) would otherwise take minutes.
            None: `rounds * repeats` turns (the benchmark).
    """
    names = list(sessions)
    samples: dict[str, dict[int, np.ndarray]] = {n: {} for n in names}
    for b in config.batch_sizes:
        feed = _batch(x, b)
        run_s = {}
        for name in names:
            for _ in range(max(1, config.warmup)):
                started = time.perf_counter()
                sessions[name].run(None, feed)
            run_s[name] = time.perf_counter() - started
        # One untimed run before each timed one: the timed one then finds this model's weights in
        # cache, as a server running it request after request does, whatever ran in between here
        # (timed cold, small models measured up to 20% slower among 30 others than among 3). A run
        # of tens of milliseconds streams its weights many times over and warms itself: no pair.
        paired = {n: run_s[n] < SELF_WARMING_RUN_S for n in names}
        turn_s = sum((2 if paired[n] else 1) * run_s[n] for n in names)
        turns = config.rounds * config.repeats
        if budget_s is not None:
            turns = min(turns, max(MIN_TURNS, int(budget_s / turn_s)))
        times = {n: np.empty(turns) for n in names}
        for turn in range(turns):
            k = turn % len(names)
            for name in names[k:] + names[:k]:
                if paired[name]:
                    sessions[name].run(None, feed)
                started = time.perf_counter()
                sessions[name].run(None, feed)
                times[name][turn] = time.perf_counter() - started
        for name in names:
            samples[name][b] = times[name] * 1e3
    return samples


def time_model_bytes(model: bytes | str, feed: dict[str, np.ndarray], threads: int, repeats: int, warmup: int) -> float:
    """Median milliseconds of one run of an ONNX model (bytes or path) with the benchmark's settings."""
    from pruneops.runtimes.onnxruntime.files import make_session, time_session

    return float(np.median(time_session(make_session(model, threads), feed, repeats, warmup)))


def measured_latency(
    models: dict[str, nn.Module | Path],
    input_shape,
    timing,
    budget_s: float | None = None,
    form: str | dict[str, str] = "fp32",
) -> dict[str, dict[int, float]]:
    """Median ms per model and batch size of their real ONNX exports, timed interleaved round by round.

    Args:
        models: The models to export and time, the first a module; an ONNX file (a reference
            model) is timed as it is, in no other form.
        input_shape: One sample's shape.
        timing: A `BenchmarkConfig` (threads, batch sizes, warm-up, repeats, rounds), or one per
            batch size (each naming that batch size), so that each is timed as long as it needs
            while every model is exported once.
        budget_s: Seconds of timed runs per batch size at most (see `measure_latencies`); None: all.
        form: The form timed: `fp32`, or a quantizer's name (`static`, `dynamic`): each export is
            quantized as the quantize stage would (`pruneops.task.classification.quantize.quantized_copy`), calibrated
            on the timing inputs (their values do not change what the INT8 graph costs); or each
            model's form, by name (forms then timed interleaved with each other).
    """
    import tempfile

    from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session
    from pruneops.runtimes.onnxruntime.quantizers import quantized_copy
    from pruneops.runtimes.onnxruntime.timing import measure_latencies

    timings = list(timing.values()) if isinstance(timing, dict) else [timing]
    biggest = max(b for t in timings for b in t.batch_sizes)
    x = timing_inputs(next(iter(models.values())), input_shape, biggest)
    with tempfile.TemporaryDirectory(prefix="pruneops-latency-") as tmp:
        sessions = {}
        for name, model in models.items():
            if isinstance(model, Path):
                sessions[name] = _reference_session(model, timings[0].threads, sessions)
                continue
            path = Path(tmp) / f"{name}.onnx"
            export_onnx_file(model, list(input_shape), path, 18)
            model_form = form[name] if isinstance(form, dict) else form
            if model_form != "fp32":
                quantized_copy(path, path.with_suffix(f".{model_form}.onnx"), model_form, x)
                path = path.with_suffix(f".{model_form}.onnx")
            sessions[name] = make_session(path, timings[0].threads)
        medians: dict[str, dict[int, float]] = {n: {} for n in models}
        for each in timings:
            for name, per in measure_latencies(sessions, x, each, budget_s).items():
                medians[name].update({b: float(np.median(t)) for b, t in per.items()})
    return medians


def _reference_session(path: Path, threads: int, exported: dict):
    """A session of a given ONNX file, refused unless it takes the inputs the exports take.

    Raises:
        ConfigError: The file is missing or not a model, its inputs are named otherwise, or its batch axis
            is fixed.
    """
    from pruneops.runtimes.onnxruntime.files import make_session

    if not path.is_file():
        raise ConfigError(f"prune.target.reference: {path} not found")
    try:
        session = make_session(path, threads)
    except Exception as exc:  # ONNX Runtime raises its own types for a file that is not a model
        raise ConfigError(f"prune.target.reference: {path} is not an ONNX model ONNX Runtime loads: {exc}") from None
    names = sorted(i.name for i in session.get_inputs())
    wanted = sorted(i.name for i in next(iter(exported.values())).get_inputs())
    if names != wanted:
        raise ConfigError(
            f"prune.target.reference: {path} takes inputs {', '.join(names)}; the model's export takes "
            f"{', '.join(wanted)} (the two are timed on the same inputs)"
        )
    fixed = [f"{i.name} ({i.shape[0]})" for i in session.get_inputs() if i.shape and isinstance(i.shape[0], int)]
    if fixed:
        raise ConfigError(
            f"prune.target.reference: {path} has a fixed batch size in {', '.join(fixed)}; it is timed at "
            "every batch the gate measures: export it with a dynamic batch axis"
        )
    return session
