"""`quantize` stage: ONNX Runtime INT8 of the fine-tuned model, chosen by measurement."""

from __future__ import annotations

import logging
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.checkpoint import load_checkpoint
from pruneops.config import QuantizeConfig
from pruneops.data import load_prepared
from pruneops.errors import QualityGateError
from pruneops.io import Layout, dump_json, staged_output_paths
from pruneops.onnx_utils import INPUT_NAME, export_onnx_file, file_size, make_session, median_latency_ms, ort_accuracy
from pruneops.registry import Registry
from pruneops.stages import StageReport

Quantizer = Callable[[Path, Path, np.ndarray, QuantizeConfig], None]
QUANTIZERS: Registry[Quantizer] = Registry("quantizer")


class _Calibration:
    """Feeds calibration samples to ONNX Runtime's static quantizer, 32 at a time."""

    def __init__(self, x: np.ndarray):
        self._batches = iter([x[i : i + 32] for i in range(0, len(x), 32)])

    def get_next(self) -> dict | None:
        batch = next(self._batches, None)
        return None if batch is None else {INPUT_NAME: batch}


@QUANTIZERS.register("static", "QDQ with calibrated activations (uint8 act/int8 weights by default)")
def quantize_static_qdq(src: Path, dst: Path, calib: np.ndarray, config: QuantizeConfig) -> None:
    """Static QDQ quantization calibrated (MinMax) on training samples."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    act = QuantType.QUInt8 if config.activation_type == "uint8" else QuantType.QInt8
    quantize_static(
        str(src),
        str(dst),
        _Calibration(calib),
        quant_format=QuantFormat.QDQ,
        per_channel=config.per_channel,
        activation_type=act,
        weight_type=QuantType.QInt8,
    )


@QUANTIZERS.register("dynamic", "int8 weights, activations quantized at run time (fast for Linear)")
def quantize_dynamic_int8(src: Path, dst: Path, calib: np.ndarray, config: QuantizeConfig) -> None:
    """Dynamic quantization: weights int8 offline, activations per batch at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), per_channel=config.per_channel, weight_type=QuantType.QInt8)


@dataclass(frozen=True)
class QuantizeReport(StageReport):
    """The chosen INT8 model and every candidate's figures."""

    method: str
    fp32_val_accuracy: float
    val_accuracy: float
    test_accuracy: float
    fp32_test_accuracy: float
    latency_ms_b1: float
    fp32_latency_ms_b1: float
    size_bytes: int
    candidates: dict
    model_path: Path

    def summary(self) -> str:
        return (
            f"{self.method}: test accuracy {100 * self.test_accuracy:.2f}% "
            f"(fp32 {100 * self.fp32_test_accuracy:.2f}%), batch-1 {self.latency_ms_b1:.4f} ms "
            f"(fp32 {self.fp32_latency_ms_b1:.4f} ms) -> {self.model_path}"
        )


def _preprocess(src: Path, dst: Path) -> None:
    """ONNX Runtime's recommended pre-processing (shape inference, fusions) before quantizing."""
    import onnx
    from onnxruntime.quantization.shape_inference import quant_pre_process

    model = onnx.load(str(src))
    # The exporter's value_info names clash with tensors the quantizer adds for folded
    # BatchNorm biases ("<weight>_bias"); shapes are re-inferred anyway.
    del model.graph.value_info[:]
    cleaned = dst.with_suffix(".clean.onnx")
    onnx.save(model, str(cleaned))
    quant_pre_process(str(cleaned), str(dst), skip_symbolic_shape=True)


def quantize_model(config: QuantizeConfig, layout: Layout | None = None) -> QuantizeReport:
    """Quantizes the fine-tuned model to INT8 with ONNX Runtime and measures the result.

    Candidates (`static`, `dynamic`, or both for `auto`) are compared on validation accuracy
    and batch-1 latency on this machine; `auto` keeps the fastest whose validation accuracy is
    within `accuracy_tolerance` of fp32. Test accuracy is measured on the chosen model.

    Raises:
        QualityGateError: No candidate is within the accuracy tolerance.
    """
    layout = layout or Layout()
    logging.getLogger("onnxruntime").setLevel(logging.ERROR)
    torch.set_num_threads(config.threads)
    meta, train, val, test = load_prepared(layout.stage_dir("validate"))
    model = load_checkpoint(layout.stage_dir("finetune") / "model.safetensors").model
    names = QUANTIZERS.names() if config.method == "auto" else [config.method]
    for name in names:
        QUANTIZERS.get(name)
    rng = np.random.default_rng(0)
    calib = train.x[rng.choice(len(train), min(config.calibration_samples, len(train)), replace=False)]
    one = val.x[:1]

    work = Path(tempfile.mkdtemp(prefix="pruneops-quant-"))
    try:
        fp32 = work / "fp32.onnx"
        export_onnx_file(model, meta.input_shape, work / "raw.onnx", config.opset)
        _preprocess(work / "raw.onnx", fp32)
        sess = make_session(fp32, config.threads)
        fp32_val = ort_accuracy(sess, val.x, val.y)
        fp32_test = ort_accuracy(sess, test.x, test.y)
        fp32_lat = median_latency_ms(sess, one, config.latency_repeats)
        candidates: dict[str, dict] = {}
        for name in names:
            dst = work / f"{name}.onnx"
            QUANTIZERS.get(name)(fp32, dst, calib, config)
            s = make_session(dst, config.threads)
            candidates[name] = {
                "val_accuracy": ort_accuracy(s, val.x, val.y),
                "latency_ms_b1": median_latency_ms(s, one, config.latency_repeats),
                "size_bytes": file_size(dst),
            }
            candidates[name]["within_tolerance"] = (
                fp32_val - candidates[name]["val_accuracy"] <= config.accuracy_tolerance
            )
        eligible = [n for n in names if candidates[n]["within_tolerance"]]
        if not eligible:
            figures = ", ".join(f"{n} {100 * (c['val_accuracy'] - fp32_val):+.2f} pts" for n, c in candidates.items())
            raise QualityGateError(
                f"no INT8 candidate within quantize.accuracy_tolerance={config.accuracy_tolerance} of fp32 "
                f"validation accuracy ({figures})"
            )
        chosen = min(eligible, key=lambda n: candidates[n]["latency_ms_b1"])
        chosen_path = work / f"{chosen}.onnx"
        test_acc = ort_accuracy(make_session(chosen_path, config.threads), test.x, test.y)
        out_dir, metrics_path = layout.stage_dir("quantize"), layout.metrics("quantize")
        report = QuantizeReport(
            method=chosen,
            fp32_val_accuracy=fp32_val,
            val_accuracy=candidates[chosen]["val_accuracy"],
            test_accuracy=test_acc,
            fp32_test_accuracy=fp32_test,
            latency_ms_b1=candidates[chosen]["latency_ms_b1"],
            fp32_latency_ms_b1=fp32_lat,
            size_bytes=candidates[chosen]["size_bytes"],
            candidates=candidates,
            model_path=out_dir / "model_int8.onnx",
        )
        with staged_output_paths(out_dir, metrics_path) as staged:
            tmp = staged.dir(out_dir)
            shutil.copyfile(chosen_path, tmp / "model_int8.onnx")
            dump_json(
                {"selection": "fastest within tolerance on validation", **report.metrics()}, tmp / "quantize.json"
            )
            dump_json(report.metrics(), staged.path(metrics_path))
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return report
