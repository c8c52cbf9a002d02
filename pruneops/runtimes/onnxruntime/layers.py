"""The per-layer latency table (NetAdapt-style lookup table).

Each Conv and Linear layer is timed alone, as a one-operator ONNX graph in ONNX Runtime with the
benchmark's thread count, at the shapes pruning can give it; the table keeps those times keyed by
layer shape and batch, tagged with the machine.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pruneops.models.profiling import forward_with_hooks
from pruneops.runtimes.onnxruntime.timing import time_model_bytes

FIELDS = ("cin", "cout", "groups")


@dataclass(frozen=True)
class LayerShape:
    """What one Conv2d/Linear costs depends on: its channels, kernel and input size."""

    kind: str  # "conv" | "linear"
    cin: int
    cout: int
    groups: int = 1
    kernel: tuple[int, int] = (1, 1)
    stride: tuple[int, int] = (1, 1)
    padding: tuple[int, int] = (0, 0)
    dilation: tuple[int, int] = (1, 1)
    spatial: tuple[int, ...] = ()  # conv: (H, W) of the input; linear: leading dims per sample

    def key(self, batch: int) -> str:
        """The table key of this shape at a batch size."""
        return _shape_key(self, batch)

    def with_fields(self, values: dict[str, int]) -> LayerShape:
        """This shape with some of `cin`, `cout`, `groups` replaced (at least 1 each)."""
        return replace(self, **{k: max(1, int(v)) for k, v in values.items()})


@functools.lru_cache(maxsize=1 << 16)
def _shape_key(shape: LayerShape, batch: int) -> str:
    # Cached: an allocation looks up a million keys, and `asdict` made that most of its time.
    return json.dumps([batch, *asdict(shape).values()], separators=(",", ":"))


def _pair(v: Any) -> tuple[int, int]:
    return tuple(v) if isinstance(v, tuple) else (int(v), int(v))


@torch.no_grad()
def layer_shapes(model: nn.Module, input_shape: list[int] | tuple[int, ...]) -> dict[str, LayerShape]:
    """Shape of every Conv2d and Linear layer of `model` on one sample, by module name."""
    shapes: dict[str, LayerShape] = {}

    def hook(name: str):
        def record(module: nn.Module, inputs: tuple, _: torch.Tensor) -> None:
            x = inputs[0]
            if isinstance(module, nn.Conv2d):
                shapes[name] = LayerShape(
                    "conv",
                    module.in_channels,
                    module.out_channels,
                    module.groups,
                    _pair(module.kernel_size),
                    _pair(module.stride),
                    _pair(module.padding) if not isinstance(module.padding, str) else (0, 0),
                    _pair(module.dilation),
                    tuple(int(d) for d in x.shape[2:]),
                )
            else:
                shapes[name] = LayerShape(
                    "linear", module.in_features, module.out_features, spatial=tuple(int(d) for d in x.shape[1:-1])
                )

        return record

    forward_with_hooks(model, input_shape, hook, lambda m: isinstance(m, (nn.Conv2d, nn.Linear)))
    return shapes


def _layer_graph(shape: LayerShape, batch: int) -> tuple[bytes, dict[str, np.ndarray]]:
    """A one-operator ONNX model of `shape` and a feed for it."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    if shape.kind == "conv":
        x_shape = [batch, shape.cin, *shape.spatial]
        weight = rng.standard_normal((shape.cout, shape.cin // shape.groups, *shape.kernel)).astype(np.float32)
        node = helper.make_node(
            "Conv",
            ["x", "w", "b"],
            ["y"],
            group=shape.groups,
            strides=list(shape.stride),
            pads=[*shape.padding, *shape.padding],
            dilations=list(shape.dilation),
        )
        inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.zeros(shape.cout, np.float32), "b")]
        nodes = [node]
    else:
        x_shape = [batch, *shape.spatial, shape.cin]
        weight = rng.standard_normal((shape.cin, shape.cout)).astype(np.float32)
        inits = [numpy_helper.from_array(weight, "w"), numpy_helper.from_array(np.zeros(shape.cout, np.float32), "b")]
        nodes = [helper.make_node("MatMul", ["x", "w"], ["h"]), helper.make_node("Add", ["h", "b"], ["y"])]
    graph = helper.make_graph(
        nodes,
        "layer",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, x_shape)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    feed = {"x": rng.standard_normal(x_shape).astype(np.float32)}
    return model.SerializeToString(), feed


def _elementwise_graph(dims: list[int]) -> tuple[bytes, dict[str, np.ndarray]]:
    """A one-Relu ONNX model: what running any one-operator graph on this input costs."""
    from onnx import TensorProto, helper

    graph = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])],
        "overhead",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, dims)],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9
    return model.SerializeToString(), {"x": np.random.default_rng(0).standard_normal(dims).astype(np.float32)}


def _quantized_bytes(model: bytes, feed: dict[str, np.ndarray], form: str) -> bytes:
    """A one-operator model quantized by the quantizer `form`, calibrated on its feed."""
    import tempfile

    import onnx

    from pruneops.runtimes.onnxruntime.quantizers import quantized_copy

    proto = onnx.load_from_string(model)
    # Calibration feeds the graph in batches of its own size; the layer graph's batch is fixed
    # (64 would refuse 32), so it is made free as in the whole-model exports.
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with tempfile.TemporaryDirectory(prefix="pruneops-layer-") as tmp:
        src, dst = Path(tmp) / "layer.onnx", Path(tmp) / f"layer.{form}.onnx"
        src.write_bytes(proto.SerializeToString())
        quantized_copy(src, dst, form, feed)
        return dst.read_bytes()


@dataclass
class LatencyTable:
    """Measured milliseconds per layer shape and batch, on one machine (JSON on disk)."""

    machine: dict[str, Any]
    entries: dict[str, float] = field(default_factory=dict)
    repeats: int = 30
    warmup: int = 5
    measured: int = 0  # entries measured by this process

    def layer_ms(self, shape: LayerShape, batch: int, form: str = "fp32") -> float:
        """The compute time of `shape` at `batch` in `form`, measured now if the table lacks it.

        A one-operator graph also pays for the call and for moving its input and output; that
        cost (timed on an element-wise graph with the same input) is taken off, so that the
        table sums what the layers compute rather than how many graphs were run. A `form` other
        than fp32 (`prune.target.form`) times the graph quantized as the quantize stage would:
        INT8 kernels have their own fast channel counts (docs/explanation/int8.md#int8-table).
        """
        key = shape.key(batch) if form == "fp32" else f"{form}:{shape.key(batch)}"
        if key not in self.entries:
            model, feed = _layer_graph(shape, batch)
            if form != "fp32":
                model = _quantized_bytes(model, feed, form)
            repeats = max(5, self.repeats // max(1, batch // 8))  # large batches take longer per run
            raw = time_model_bytes(model, feed, self.machine["threads"], repeats, self.warmup)
            self.entries[key] = max(raw - self._overhead(shape, batch, repeats), 0.01 * raw)
            self.measured += 1
        return self.entries[key]

    def _overhead(self, shape: LayerShape, batch: int, repeats: int) -> float:
        dims = [batch, shape.cin, *shape.spatial] if shape.kind == "conv" else [batch, *shape.spatial, shape.cin]
        key = json.dumps(["overhead", *dims])
        if key not in self.entries:
            model, feed = _elementwise_graph(dims)
            self.entries[key] = time_model_bytes(model, feed, self.machine["threads"], repeats, self.warmup)
        return self.entries[key]

    def save(self, path: Path) -> None:
        """Writes the table as JSON."""
        path.write_text(json.dumps({"machine": self.machine, "entries": self.entries}, indent=0) + "\n")

    @classmethod
    def load(cls, path: Path, machine: dict[str, Any]) -> tuple[LatencyTable, bool]:
        """The table at `path` if it was measured on `machine`; else an empty one (and False)."""
        data = json.loads(Path(path).read_text())
        if data.get("machine") != machine:
            return cls(machine), False
        return cls(machine, {k: float(v) for k, v in data["entries"].items()}), True


def width_grid(size: int, points: int = 48) -> list[int]:
    """Widths to consider for a unit: every one up to 16, then a step that keeps about `points`."""
    step = max(2, -(-size // points))
    step += step % 2
    return sorted({*range(1, min(size, 16) + 1), *range(step, size + 1, step), size})


def layer_mmacs(shape: LayerShape) -> float:
    """Millions of multiply-accumulates of one layer on one sample."""
    per_output = shape.cin // shape.groups * shape.kernel[0] * shape.kernel[1]
    positions = math.prod(shape.spatial) if shape.kind == "linear" else _conv_positions(shape)
    return per_output * shape.cout * positions / 1e6


def _conv_positions(shape: LayerShape) -> int:
    out = [
        (size + 2 * pad - dil * (k - 1) - 1) // stride + 1
        for size, pad, dil, k, stride in zip(
            shape.spatial, shape.padding, shape.dilation, shape.kernel, shape.stride, strict=True
        )
    ]
    return max(1, math.prod(out))
