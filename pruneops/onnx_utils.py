"""ONNX export and ONNX Runtime helpers shared by `quantize`, `export`, `benchmark` and serving.

torch is imported only inside `export_onnx_file`: the serving image has ONNX Runtime and no torch.
"""

from __future__ import annotations

import io
import logging
import os
import time
import warnings
from contextlib import redirect_stderr, redirect_stdout
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from torch import nn

INPUT_NAME = "input"
OUTPUT_NAME = "logits"


def export_onnx_file(model: nn.Module, input_shape: list[int], path: Path, opset: int) -> None:
    """Exports `model` to ONNX with a dynamic batch axis (TorchDynamo exporter)."""
    import torch

    model.eval()
    example = torch.zeros(2, *input_shape)
    batch = torch.export.Dim("batch", min=1, max=4096)
    # The exporter narrates every pass on stdout/stderr; keep stage output readable.
    logging.getLogger("torch.onnx").setLevel(logging.ERROR)
    with warnings.catch_warnings(), redirect_stdout(io.StringIO()), redirect_stderr(io.StringIO()):
        warnings.simplefilter("ignore")
        program = torch.onnx.export(
            model,
            (example,),
            dynamo=True,
            opset_version=opset,
            input_names=[INPUT_NAME],
            output_names=[OUTPUT_NAME],
            dynamic_shapes=({0: batch},),
            external_data=False,
        )
    program.save(str(path))


def make_session(path: Path, threads: int = 1):
    """An ONNX Runtime CPU session with full graph optimisation and a fixed thread count."""
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.intra_op_num_threads = threads
    opts.inter_op_num_threads = 1
    opts.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    opts.log_severity_level = 3
    return ort.InferenceSession(str(path), sess_options=opts, providers=["CPUExecutionProvider"])


def ort_logits(session, x: np.ndarray, batch_size: int = 256) -> np.ndarray:
    """Runs `session` over `x` in batches and returns the logits."""
    outs = [session.run(None, {INPUT_NAME: x[i : i + batch_size]})[0] for i in range(0, len(x), batch_size)]
    return np.concatenate(outs)


def ort_accuracy(session, x: np.ndarray, y: np.ndarray) -> float:
    """Top-1 accuracy of an ONNX Runtime session."""
    return float((ort_logits(session, x).argmax(1) == y).mean())


def time_session(session, x: np.ndarray, repeats: int, warmup: int) -> np.ndarray:
    """Per-call latencies in milliseconds of `repeats` runs on `x`, after `warmup` runs."""
    feed = {INPUT_NAME: np.ascontiguousarray(x)}
    for _ in range(warmup):
        session.run(None, feed)
    times = np.empty(repeats)
    for i in range(repeats):
        t0 = time.perf_counter()
        session.run(None, feed)
        times[i] = time.perf_counter() - t0
    return times * 1e3


def median_latency_ms(session, x: np.ndarray, repeats: int, warmup: int = 20) -> float:
    """Median latency in milliseconds of `session` on `x` (see `time_session`)."""
    return float(np.median(time_session(session, x, repeats, warmup)))


def file_size(path: Path) -> int:
    """Size of a file in bytes."""
    return os.path.getsize(path)
