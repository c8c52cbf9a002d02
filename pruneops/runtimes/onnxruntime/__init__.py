"""ONNX Runtime on the CPU: a classifier exported to ONNX in fp32, or quantized to static or dynamic INT8.

The `.onnx` file is the artefact. Its modules: `files` (export, sessions, logits), `quantizers`
(the INT8 forms), `timing` (sessions timed interleaved), `layers` (one-operator graphs for the
latency table).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

from pruneops.config import BenchmarkConfig, QuantizeConfig
from pruneops.runtimes.base import Runtime
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session
from pruneops.runtimes.onnxruntime.quantizers import QUANTIZERS, preprocess_for_quantization
from pruneops.runtimes.onnxruntime.timing import measure_latencies


@dataclass(frozen=True)
class BatchWorkload:
    """What a classifier is timed on: one sample (plain or named inputs) repeated to each of `config`'s batches.

    `budget_s` caps the timed turns per batch size (a gate inside a stage); None: `config`'s rounds x repeats.
    """

    x: np.ndarray | dict[str, np.ndarray]
    config: BenchmarkConfig
    budget_s: float | None = None


class OnnxRuntime(Runtime):
    """ONNX Runtime, CPU execution provider."""

    name: ClassVar[str] = "onnxruntime"
    task: ClassVar[str] = "classification"
    precisions: ClassVar[tuple[str, ...]] = ("fp32", "static", "dynamic")
    export_kind: ClassVar[str] = "an ONNX model file"

    def export(
        self,
        model: Any,
        out: Path,
        precisions: Sequence[str],
        *,
        input_shape: Sequence[int],
        calibration: np.ndarray | dict[str, np.ndarray] | None = None,
        config: QuantizeConfig | None = None,
    ) -> dict[str, Path]:
        """`out/<precision>.onnx` each: fp32 as exported, an INT8 form from the pre-processed graph."""
        self.check_precisions(precisions)
        config = config or QuantizeConfig()
        out = Path(out)
        out.mkdir(parents=True, exist_ok=True)
        fp32 = out / "fp32.onnx"
        export_onnx_file(model, list(input_shape), fp32, config.opset, config.exporter)
        written = {"fp32": fp32} if "fp32" in precisions else {}
        with tempfile.TemporaryDirectory(prefix="pruneops-ort-") as work:
            prepared = Path(work) / "prepared.onnx"
            for precision in (p for p in precisions if p != "fp32"):
                if not prepared.exists():
                    preprocess_for_quantization(fp32, prepared)
                written[precision] = out / f"{precision}.onnx"
                QUANTIZERS.get(precision)(prepared, written[precision], calibration, config)
        if "fp32" not in precisions:
            fp32.unlink()
        return written

    def open(self, artefact: Path, threads: int = 1) -> Any:
        return make_session(artefact, threads)

    def time(self, artefacts: Mapping[str, Path], workload: BatchWorkload) -> dict[str, dict[int, np.ndarray]]:
        """Latency samples (ms) per model and batch size, timed interleaved (`measure_latencies`)."""
        sessions = {name: make_session(path, workload.config.threads) for name, path in artefacts.items()}
        return measure_latencies(sessions, workload.x, workload.config, workload.budget_s)

    def contract(self, artefact: Path, metadata: Mapping[str, Any]) -> dict[str, Any]:
        """Its named inputs (with their per-example shapes) and what `metadata` says of its data and classes."""
        from pruneops.runtimes.onnxruntime.contract import probe, serving_contract

        session = make_session(artefact)
        num_classes = probe(session, metadata)[1]
        inputs = [(i.name, i.type, list(i.shape[1:])) for i in session.get_inputs()]
        return serving_contract(inputs, num_classes, dict(metadata), metadata.get("tokenizer_sha256"))

    def files(self, artefact: Path) -> list[Path]:
        return [Path(artefact)]

    def recognises(self, artefact: Path) -> bool:
        return Path(artefact).suffix == ".onnx" and Path(artefact).is_file()

    def versions(self) -> dict[str, str]:
        import onnxruntime

        return {"onnxruntime": onnxruntime.__version__}


def copy_artefact(src: Path, dst: Path) -> Path:
    """A copy of an export (one file)."""
    shutil.copyfile(src, dst)
    return dst


RUNTIME = OnnxRuntime()
