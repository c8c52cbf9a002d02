"""`pruneops doctor`: whether this machine's timings can carry the decisions the pipeline makes on them.

Every gate compares medians timed interleaved in one process with small margins (a 1 % tie between
precisions, a band of 0.95-1.01 of a latency target, a 5 % speed-up floor). `check_noise` times
fresh sessions of one model side by side, pass after pass: identical sessions that disagree, or
passes that drift, say by how much a reading here can move with nothing changed. `check_fit`
reads how well the latency stage's table predicted held-out exports and how far the prune stage's
prediction of its kept plan landed from its measurement.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.core.io import Layout, read_json
from pruneops.runtimes import get_runtime
from pruneops.timing.machine import cpu_features, cpu_name

# What the gates' margins assume of identical models timed interleaved (docs/explanation/int8.md#ties).
TIE = 0.01
PREDICTION_TOLERANCE = 0.15  # a latency table off by more than this misjudges plans near a target


@dataclass(frozen=True)
class Finding:
    """One check: what was measured and whether it is within what the pipeline assumes."""

    check: str
    ok: bool
    text: str

    def line(self) -> str:
        """`ok      noise: ...` or `warning noise: ...`."""
        return f"{'ok' if self.ok else 'warning':<8}{self.check}: {self.text}"


def check_machine() -> list[Finding]:
    """The CPU, its features, the load on it now, and its frequency governor where Linux says."""
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else 0.0
    cores = os.cpu_count() or 1
    governor = Path("/sys/devices/system/cpu/cpu0/cpufreq/scaling_governor")
    found = [Finding("machine", True, f"{cpu_name()} ({cpu_features() or 'features unknown'}), {cores} cores")]
    found.append(
        Finding("load", load < 0.5 * cores, f"1-minute load {load:.2f} on {cores} cores (other work skews timings)")
    )
    if governor.is_file():
        mode = governor.read_text().strip()
        found.append(Finding("governor", mode == "performance", f"CPU frequency governor {mode}"))
    return found


def check_noise(model: Path, sessions: int = 3, passes: int = 4, calls: int = 200, threads: int = 1) -> list[Finding]:
    """Times `sessions` fresh sessions of one ONNX model interleaved, `passes` times: spread and drift.

    The spread is the largest ratio between identical sessions' medians within a pass (what a
    comparison of two models can be off by, with nothing different between them); the drift the
    largest ratio between two passes' medians (what a table timed minutes before its gate can be).
    """
    from pruneops.config import BenchmarkConfig
    from pruneops.runtimes.onnxruntime import BatchWorkload

    runtime = get_runtime("onnxruntime")
    session = runtime.open(model)
    spec = session.get_inputs()[0]
    shape = [1 if not isinstance(d, int) else d for d in spec.shape]
    dtype = np.int64 if "int64" in spec.type else np.float32
    x = np.ones(shape[1:], dtype=dtype)[None] if dtype is np.int64 else np.zeros(shape, dtype=dtype)
    config = BenchmarkConfig(threads=threads, batch_sizes=[1], warmup=20, repeats=calls, rounds=1)
    copies = {f"session{i}": model for i in range(sessions)}
    spreads, medians = [], []
    for _ in range(passes):
        samples = runtime.time(copies, BatchWorkload(x[:1], config))
        per_session = [float(np.median(s[1])) for s in samples.values()]
        spreads.append(max(per_session) / min(per_session) - 1)
        medians.append(float(np.median(per_session)))
    # Judged on the figures as printed (0.1 %): a spread shown as "1.0 %" is the 1 % tie, not over it.
    spread, drift = round(max(spreads), 3), round(max(medians) / min(medians) - 1, 3)
    return [
        Finding(
            "noise",
            spread <= TIE,
            f"identical sessions of {model.name} differ by up to {100 * spread:.1f} % within a pass "
            f"({1000 * min(medians):.1f} µs a call; the gates take {100 * TIE:.0f} % as a tie)",
        ),
        Finding(
            "drift",
            drift <= 5 * TIE,
            f"the same model's median moved {100 * drift:.1f} % between {passes} passes (interleaving cancels this "
            "only where it hits every model alike)",
        ),
    ]


def check_fit(layout: Layout) -> list[Finding]:
    """How well the latency stage's table predicted exports it held out, and the prune stage's kept plan."""
    found = []
    latency = layout.metrics("latency")
    predictors = read_json(latency).get("predictors", {}) if latency.is_file() else {}
    for form, batches in predictors.items():
        for batch, fit in batches.items():
            error = fit["mean_held_out_error"][fit["predictor"]]
            found.append(
                Finding(
                    "latency table",
                    error <= PREDICTION_TOLERANCE,
                    f"{form} at batch {batch}: the {fit['predictor']} predictor is off by {100 * error:.1f} % on "
                    "held-out exports",
                )
            )
    prune = layout.metrics("prune")
    error = read_json(prune).get("latency_prediction_error") if prune.is_file() else None
    if error is not None:
        found.append(
            Finding(
                "prediction",
                abs(error) <= PREDICTION_TOLERANCE,
                f"the table's prediction of the kept plan was {100 * error:+.1f} % off its measurement",
            )
        )
    if not found:
        found.append(Finding("latency table", True, "no latency table here (run the latency stage to check its fit)"))
    return found


def reference_model(layout: Layout, work: Path) -> Path:
    """The project's exported dense model, or a small stand-in written to `work` (an MLP's cost per call)."""
    exported = layout.stage_dir("export") / "dense_fp32.onnx"
    if exported.is_file():
        return exported
    import torch

    model = torch.nn.Sequential(
        torch.nn.Flatten(), torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 10)
    )
    return get_runtime("onnxruntime").export(model.eval(), work, ["fp32"], input_shape=[256])["fp32"]


def diagnose(layout: Layout, passes: int = 4, emit: Callable[[str], None] = print) -> list[Finding]:
    """Every check, each printed as it finishes."""
    findings = check_machine()
    for f in findings:
        emit(f.line())
    with tempfile.TemporaryDirectory(prefix="pruneops-doctor-") as work:
        model = reference_model(layout, Path(work))
        for f in (*check_noise(model, passes=passes), *check_fit(layout)):
            emit(f.line())
            findings.append(f)
    return findings
