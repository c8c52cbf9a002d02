"""ONNX Runtime INT8 quantizers, chosen by name (`quantize.method`).

`quantized_copy` makes the graph the quantize stage would make, for the latency table and the
prune gate to time.
"""

from __future__ import annotations

import platform
import shutil
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np

from pruneops.config import QuantizeConfig
from pruneops.core.inputs import as_feed, count_rows, rows
from pruneops.core.plugins import Registry
from pruneops.timing.machine import cpu_flags

Quantizer = Callable[[Path, Path, np.ndarray, QuantizeConfig], None]

QUANTIZERS: Registry[Quantizer] = Registry("quantizer")


class _Calibration:
    """Feeds calibration samples to ONNX Runtime's static quantizer, 32 at a time."""

    def __init__(self, x: np.ndarray | dict[str, np.ndarray]):
        self._batches = iter([rows(x, slice(i, i + 32)) for i in range(0, count_rows(x), 32)])

    def get_next(self) -> dict | None:
        batch = next(self._batches, None)
        return None if batch is None else as_feed(batch)


# x86 kernels that multiply u8 activations by s8 weights without VNNI (SSSE3/AVX2 `pmaddubsw`)
# add pairs of products in 16 bits and saturate; 7-bit weights avoid it
# (docs/explanation/int8.md#reduce-range).
VNNI_FLAGS = frozenset({"avx512_vnni", "avx_vnni"})

X86 = frozenset({"x86_64", "amd64", "i386", "i686"})


def weight_range(
    setting: bool | str, machine: str | None = None, flags: frozenset[str] | None = None
) -> tuple[bool, str]:
    """Whether static INT8 weights use 7 bits (`quantize.reduce_range`), and why.

    Args:
        setting: True, False, or "auto" (7 bits on x86 without VNNI).
        machine: `platform.machine()`; this machine's when None.
        flags: CPU feature flags; this machine's when None.
    """
    if setting != "auto":
        return bool(setting), f"quantize.reduce_range: {str(setting).lower()}"
    machine = (machine or platform.machine()).lower()
    if machine not in X86:
        return False, f"auto: {machine} is not x86 (the saturating u8 x s8 kernels are x86's)"
    flags = cpu_flags() if flags is None else flags
    if flags & VNNI_FLAGS:
        return False, f"auto: {sorted(flags & VNNI_FLAGS)[0]} multiplies u8 x s8 without saturating"
    return True, "auto: x86 without VNNI, whose u8 x s8 kernels saturate; weights in 7 bits"


@QUANTIZERS.register("static", "QDQ with calibrated activations (uint8 act/int8 weights by default)")
def quantize_static_qdq(
    src: Path, dst: Path, calib: np.ndarray, config: QuantizeConfig, exclude: Sequence[str] = ()
) -> None:
    """Static QDQ quantization calibrated (MinMax) on training samples; nodes named in `exclude` stay fp32."""
    from onnxruntime.quantization import QuantFormat, QuantType, quantize_static

    act = QuantType.QUInt8 if config.activation_type == "uint8" else QuantType.QInt8
    extra = {}
    if _takes_token_ids(src):
        # A transformer's attention mask becomes (1 - mask) * float32.min: calibrating the ops on
        # that path gives an infinite scale (NaN zero points) and a model at chance (measured on a
        # small BERT: val 50% vs 100% fp32). Quantizing only the matrix products keeps it exact.
        extra["op_types_to_quantize"] = ["MatMul", "Gemm"]
    quantize_static(
        str(src),
        str(dst),
        _Calibration(calib),
        quant_format=QuantFormat.QDQ,
        per_channel=config.per_channel,
        activation_type=act,
        weight_type=QuantType.QInt8,
        reduce_range=weight_range(config.reduce_range)[0],
        nodes_to_exclude=list(exclude),
        **extra,
    )


def _takes_token_ids(path: Path) -> bool:
    """Whether the ONNX model has an integer input (token ids: a text model)."""
    import onnx

    model = onnx.load(str(path), load_external_data=False)
    ints = {onnx.TensorProto.INT64, onnx.TensorProto.INT32}
    return any(i.type.tensor_type.elem_type in ints for i in model.graph.input)


@QUANTIZERS.register("fp32", "no quantization: the fp32 model (chosen when no INT8 form is faster here)")
def keep_fp32(src: Path, dst: Path, calib: np.ndarray, config: QuantizeConfig) -> None:
    """The fp32 model as it is."""
    shutil.copyfile(src, dst)


@QUANTIZERS.register("dynamic", "int8 weights, activations quantized at run time (fast for Linear)")
def quantize_dynamic_int8(src: Path, dst: Path, calib: np.ndarray, config: QuantizeConfig) -> None:
    """Dynamic quantization: weights int8 offline, activations per batch at run time."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    quantize_dynamic(str(src), str(dst), per_channel=config.per_channel, weight_type=QuantType.QInt8)


def preprocess_for_quantization(src: Path, dst: Path) -> None:
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


def quantized_copy(src: Path, dst: Path, method: str, calib: np.ndarray | dict[str, np.ndarray]) -> None:
    """`src` in the form `method` (a quantizer's name) at `dst`, with the stage's default settings.

    What the latency model and the prune stage's gate time when they measure a form other than
    fp32 (`prune.target.form`): the graph the quantize stage would make, not its accuracy.
    """
    if method == "fp32":
        shutil.copyfile(src, dst)
        return
    prepared = dst.with_suffix(".prepared.onnx")
    preprocess_for_quantization(src, prepared)
    QUANTIZERS.get(method)(prepared, dst, calib, QuantizeConfig())
