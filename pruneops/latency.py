"""A latency model measured on the machine that will serve (NetAdapt-style lookup table).

Every Conv and Linear layer of a model is timed alone, as a one-operator ONNX graph in ONNX
Runtime with the benchmark's thread count, at the shapes pruning can give it; the table keeps
those times keyed by layer shape and batch, tagged with the machine. A unit's width changes some
layers' input or output channels (found once per unit by pruning a probe copy);
one-operator timings miss what the whole graph does (layout conversions, fusions, per-call
cost that dominate at tens of microseconds), so the model itself is also exported and timed:
dense, four uniform cuts, and each unit alone at a few of its efficient widths. A prediction is
`a + sum over layers of (in-context cost per unit of a feature) * feature`, the feature being
the layer's MACs or its table time, fitted to those exports (non-negative least squares); the
feature, or the plain line `a + b * sum(layer times)`, is chosen per batch size by its error
on uniform cuts left out of the fit. Widths at which
a unit's layers are no faster than at a larger width (ONNX Runtime computes channels in blocks
of 8 or 16 here) are not "efficient": the allocator only stops units at efficient widths.
"""

from __future__ import annotations

import copy
import functools
import itertools
import json
import logging
import math
import platform
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from pruneops.checkpoint import file_sha256, load_checkpoint
from pruneops.config import AUTO_FORM, LATENCY_TARGETS, BenchmarkConfig, LatencyConfig, PruneConfig, QuantizeConfig
from pruneops.data import load_prepared
from pruneops.errors import ConfigError, DataError
from pruneops.inputs import head_tensors, run_model, timing_inputs
from pruneops.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.plots import plot_latency_staircases
from pruneops.profiling import forward_with_hooks
from pruneops.pruning.allocation import cost_of
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner, is_head_unit, round_keep
from pruneops.stages import StageReport

FIELDS = ("cin", "cout", "groups")
FORMS_FILE = "forms.json"  # in artifacts/latency: the forms to plan in and a ratio's reference
UNIT_POINTS = 4  # default exports per unit alone (`latency.unit_points`): each costs an export and a timed session
SHORTLIST_FLOOR = 0.85  # of the target: the least an alternative plan on the shortlist may be predicted at
PREDICTORS = ("mmacs", "table", "line")  # per-layer costs on MACs or table times; one line over the table sum
MISS_DIGITS = 9  # held-out relative misses equal to this many decimals are a tie (`pick_predictor`)

logger = logging.getLogger(__name__)


def machine_fingerprint(threads: int) -> dict[str, Any]:
    """What a latency measurement depends on besides the model: `machine_info` less the date and Python."""
    from pruneops.benchmark import machine_info

    info = machine_info(threads)  # its cpu_features: a VM may give two CPU generations one name
    kept = ("cpu", "cpu_features", "cores", "onnxruntime", "threads")
    return {**{k: info[k] for k in kept}, "machine": platform.machine()}


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

    from pruneops.quantize import quantized_copy

    proto = onnx.load_from_string(model)
    # Calibration feeds the graph in batches of its own size; the layer graph's batch is fixed
    # (64 would refuse 32), so it is made free as in the whole-model exports.
    proto.graph.input[0].type.tensor_type.shape.dim[0].dim_param = "batch"
    with tempfile.TemporaryDirectory(prefix="pruneops-layer-") as tmp:
        src, dst = Path(tmp) / "layer.onnx", Path(tmp) / f"layer.{form}.onnx"
        src.write_bytes(proto.SerializeToString())
        quantized_copy(src, dst, form, feed)
        return dst.read_bytes()


def time_model_bytes(model: bytes | str, feed: dict[str, np.ndarray], threads: int, repeats: int, warmup: int) -> float:
    """Median milliseconds of one run of an ONNX model (bytes or path) with the benchmark's settings."""
    from pruneops.onnx_utils import make_session, time_session

    return float(np.median(time_session(make_session(model, threads), feed, repeats, warmup)))


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
        than fp32 (`prune.latency_form`) times the graph quantized as the quantize stage would:
        INT8 kernels have their own fast channel counts (a static-INT8 3x3 conv at 28x28 here ran
        16 channels in 0.025 ms and 12 in 0.041, where fp32 took 0.038 and 0.035).
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


@dataclass(frozen=True)
class UnitLayers:
    """How one unit's width moves its layers: per (layer, field), the change per removed channel/head.

    Changes are fractional where the removed channels split between layers (the two sides of a
    concat lose channels in proportion, on average).
    """

    name: str
    size: int
    deltas: tuple[tuple[str, str, float], ...]


def probe_unit_layers(model: nn.Module, example: torch.Tensor, name: str, size: int, input_shape) -> UnitLayers:
    """Prunes a copy of `model` by half of unit `name` and reads which layer fields moved, per removed channel."""
    removed = max(1, size // 2)
    before = layer_shapes(model, input_shape)
    twin = copy.deepcopy(model)
    UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_({name: size - removed})
    after = layer_shapes(twin, input_shape)
    deltas = []
    for layer, shape in before.items():
        moved = after.get(layer)
        for f in FIELDS:
            change = getattr(shape, f) - getattr(moved, f)
            if change:
                deltas.append((layer, f, change / removed))
    return UnitLayers(name, size, tuple(deltas))


def width_grid(size: int, points: int = 48) -> list[int]:
    """Widths to consider for a unit: every one up to 16, then a step that keeps about `points`."""
    step = max(2, -(-size // points))
    step += step % 2
    return sorted({*range(1, min(size, 16) + 1), *range(step, size + 1, step), size})


@dataclass
class LatencyModel:
    """Predicts a pruned model's latency from the table: `a + b * sum(layer ms)` per batch size."""

    base: dict[str, LayerShape]
    units: dict[str, UnitLayers]
    table: LatencyTable
    calibration: dict[int, tuple[float, float]] = field(default_factory=dict)
    # Per batch: the feature ("mmacs" or "table"), intercept and each layer's in-context cost
    # per unit of that feature, fitted (non-negative least squares) on whole-model exports timed
    # in the latency stage. A batch without one predicts with the calibration line.
    layer_costs: dict[int, tuple[str, float, dict[str, float]]] = field(default_factory=dict)
    # Refitted on plans measured in the prune stage: predicted savings are scaled by this.
    savings_scale: dict[int, float] = field(default_factory=dict)
    # The whole-model exports the predictors were fitted on: "points" (key -> unit widths) and
    # "measured" (batch -> key -> median ms). Empty for a model read back from JSON.
    exports: dict[str, Any] = field(default_factory=dict)
    form: str = "fp32"  # the form the whole-model exports were timed in (`measured_latency`)
    # Per batch: each predictor's mean relative miss on the held-out uniform cuts, which chose it.
    held_out: dict[int, dict[str, float | None]] = field(default_factory=dict)

    def fit_(
        self,
        predictor: str,
        batch: int,
        points: dict[str, dict[str, int]] | None = None,
        measured: dict[str, float] | None = None,
    ) -> None:
        """Fits `predictor` ("mmacs", "table" or "line") at `batch`, on `points` or every export.

        Raises:
            ValueError: An unknown predictor, or no exports to fit on.
        """
        points = self.exports.get("points", {}) if points is None else points
        measured = self.exports.get("measured", {}).get(batch, {}) if measured is None else measured
        if predictor not in PREDICTORS or not points:
            raise ValueError(f"cannot fit predictor {predictor!r} at batch {batch} (known: {PREDICTORS})")
        times = np.array([measured[k] for k in points])
        if predictor == "line":
            self.layer_costs.pop(batch, None)
            sums = np.array([self.layer_sum(w, batch) for w in points.values()])
            self.calibration[batch] = fit_calibration(sums, times)
        else:
            self.layer_costs[batch] = fit_layer_costs(self, points, measured, predictor, batch)

    def shapes(self, widths: dict[str, int], only: set[str] | None = None) -> dict[str, LayerShape]:
        """Every layer's shape (or those in `only`) with the units at `widths` (units left out stay whole)."""
        changes: dict[tuple[str, str], float] = {}
        for name, width in widths.items():
            unit = self.units.get(name)
            if unit is None:
                continue
            for layer, f, delta in unit.deltas:
                changes[(layer, f)] = changes.get((layer, f), 0) + delta * (unit.size - width)
        out = {}
        for layer in self.base if only is None else only:
            shape = self.base[layer]
            moved = {f: round(getattr(shape, f) - changes[(layer, f)]) for f in FIELDS if (layer, f) in changes}
            out[layer] = shape.with_fields(moved) if moved else shape
        return out

    def unit_layers(self, name: str) -> set[str]:
        """The layers whose shape `name`'s width moves."""
        return {layer for layer, _, _ in self.units[name].deltas if layer in self.base}

    def layer_sum(self, widths: dict[str, int], batch: int, only: set[str] | None = None) -> float:
        """Summed table time of every layer (or those in `only`) at these widths."""
        return sum(self.table.layer_ms(s, batch, self.form) for s in self.shapes(widths, only).values())

    def predict(self, widths: dict[str, int], batch: int) -> float:
        """Predicted milliseconds of the whole model at these widths.

        With fitted layer costs at `batch`: `a + sum(cost per MAC * MACs)` over layers; without,
        `a + b * sum(layer ms)` from the one-operator table. Either way the predicted saving
        against dense is then scaled by `savings_scale` (1 until the prune stage measures plans).
        """
        if batch in self.layer_costs:
            feature, intercept, costs = self.layer_costs[batch]
            shapes = self.shapes(widths)
            raw = intercept + sum(c * self.feature(feature, shapes[n], batch) for n, c in costs.items())
            dense = intercept + sum(c * self.feature(feature, self.base[n], batch) for n, c in costs.items())
        else:
            a, b = self.calibration.get(batch, (0.0, 1.0))
            raw = a + b * self.layer_sum(widths, batch)
            dense = a + b * self.layer_sum({}, batch)
        return dense - self.savings_scale.get(batch, 1.0) * (dense - raw)

    def _raw_part(self, shapes: dict[str, LayerShape], batch: int) -> float:
        """These layers' share of the raw prediction at `batch` (before `savings_scale`)."""
        if batch in self.layer_costs:
            feature, _, costs = self.layer_costs[batch]
            return sum(costs[n] * self.feature(feature, s, batch) for n, s in shapes.items() if n in costs)
        _, b = self.calibration.get(batch, (0.0, 1.0))
        return b * sum(self.table.layer_ms(s, batch, self.form) for s in shapes.values())

    def predict_moves(self, widths: dict[str, int], name: str, candidates: list[int], batch: int) -> list[float]:
        """`predict({**widths, name: w}, batch)` for each candidate width `w`, recomputing only the layers `name` moves.

        The allocators ask this for every option of every unit at every step; predicting the
        whole model each time made an allocation over a fine staircase take minutes.
        """
        layers = self.unit_layers(name)
        scale = self.savings_scale.get(batch, 1.0)
        here = self.predict(widths, batch)
        before = self._raw_part(self.shapes(widths, layers), batch)
        after = [self._raw_part(self.shapes({**widths, name: w}, layers), batch) for w in candidates]
        return [here + scale * (raw - before) for raw in after]

    def feature(self, kind: str, shape: LayerShape, batch: int) -> float:
        """A layer's cost feature: its MACs (millions, one sample) or its one-operator table time."""
        return layer_mmacs(shape) if kind == "mmacs" else self.table.layer_ms(shape, batch, self.form)

    def unit_curve(self, name: str, batch: int) -> dict[int, float]:
        """Summed table time of the layers `name` moves, with only `name` at each grid width.

        Only those layers: summed with the rest of the model, a unit's whole range is a few
        percent of the total, and `efficient_widths`' noise margin then swallowed its staircase
        (on MobileNetV2 at 64x64, batch 64, a 960-wide expansion kept 3 widths: 40, 480, 960).
        """
        layers = self.unit_layers(name)
        return {w: self.layer_sum({name: w}, batch, layers) for w in width_grid(self.units[name].size)}

    def efficient_widths(self, name: str, batch: int, margin: float = 0.02) -> list[int]:
        """Grid widths faster than every larger one by `margin` (the fast steps of the staircase).

        The margin, of the time of the layers the unit moves, keeps timing noise from making a
        slower-looking width an extra "step". Every head count of an attention unit is kept: a
        head is a whole block of channels, and the table times only the projections, not the
        per-head attention between them; on the ViT-style workload it timed 1 head as 2 (its
        projections are all overhead there), which kept the allocation from a 1-head block, where
        the whole-model fit charges 0.006 ms per head and the MAC-target plan with a 1-head block
        measured the same ms as the allocation's (3, 2, 2) heads (docs/families-same-run).
        """
        curve = self.unit_curve(name, batch)
        if is_head_unit(name):
            return sorted(curve)
        best, keep = float("inf"), []
        for width in sorted(curve, reverse=True):
            if curve[width] < best * (1.0 - margin):
                keep.append(width)
                best = curve[width]
        return sorted(keep)

    def to_json(self) -> dict[str, Any]:
        """What the latency stage writes (`latency.json`)."""
        return {
            "machine": self.table.machine,
            "form": self.form,
            "base": {n: asdict(s) for n, s in self.base.items()},
            "units": {n: {"size": u.size, "deltas": [list(d) for d in u.deltas]} for n, u in self.units.items()},
            "calibration": {str(b): list(ab) for b, ab in self.calibration.items()},
            "layer_costs": {
                str(b): {"feature": f, "intercept": a, "costs": c} for b, (f, a, c) in self.layer_costs.items()
            },
            "mean_held_out_error": {str(b): e for b, e in self.held_out.items()},
        }

    @classmethod
    def from_json(cls, data: dict[str, Any], table: LatencyTable) -> LatencyModel:
        """Rebuilds the model written by `to_json` over a table."""

        def shape(d: dict) -> LayerShape:
            return LayerShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in d.items()})

        return cls(
            base={n: shape(d) for n, d in data["base"].items()},
            units={n: UnitLayers(n, u["size"], tuple(tuple(d) for d in u["deltas"])) for n, u in data["units"].items()},
            table=table,
            calibration={int(b): tuple(ab) for b, ab in data["calibration"].items()},
            layer_costs={
                int(b): (v["feature"], float(v["intercept"]), {n: float(c) for n, c in v["costs"].items()})
                for b, v in data.get("layer_costs", {}).items()
            },
            form=data.get("form", "fp32"),
            held_out={int(b): e for b, e in data.get("mean_held_out_error", {}).items()},
        )


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
            quantized as the quantize stage would (`pruneops.quantize.quantized_copy`), calibrated
            on the timing inputs (their values do not change what the INT8 graph costs); or each
            model's form, by name (forms then timed interleaved with each other).
    """
    import tempfile

    from pruneops.benchmark import measure_latencies
    from pruneops.onnx_utils import export_onnx_file, make_session
    from pruneops.quantize import quantized_copy

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
    from pruneops.onnx_utils import make_session

    if not path.is_file():
        raise ConfigError(f"prune.target_reference: {path} not found")
    try:
        session = make_session(path, threads)
    except Exception as exc:  # ONNX Runtime raises its own types for a file that is not a model
        raise ConfigError(f"prune.target_reference: {path} is not an ONNX model ONNX Runtime loads: {exc}") from None
    names = sorted(i.name for i in session.get_inputs())
    wanted = sorted(i.name for i in next(iter(exported.values())).get_inputs())
    if names != wanted:
        raise ConfigError(
            f"prune.target_reference: {path} takes inputs {', '.join(names)}; the model's export takes "
            f"{', '.join(wanted)} (the two are timed on the same inputs)"
        )
    fixed = [f"{i.name} ({i.shape[0]})" for i in session.get_inputs() if i.shape and isinstance(i.shape[0], int)]
    if fixed:
        raise ConfigError(
            f"prune.target_reference: {path} has a fixed batch size in {', '.join(fixed)}; it is timed at "
            "every batch the gate measures: export it with a dynamic batch axis"
        )
    return session


def build_latency_model(
    model: nn.Module,
    example: torch.Tensor,
    input_shape,
    units: Iterable[tuple[str, int]],
    table: LatencyTable,
    batches: Iterable[int],
    form: str = "fp32",
    unit_points: int = UNIT_POINTS,
) -> LatencyModel:
    """Probes the units, fills the table on every unit's width grid and measures real exports.

    Exported and timed together (interleaved): the dense model; copies with every unit at the
    first efficient width above 3/4, 1/2, 1/3 and 1/4 of its size (on which the calibration line
    `a + b * sum(layer ms)` is fitted); and, per unit, the model with only that unit at up to
    `unit_points` of its efficient widths. Then `pick_predictor` picks the predictor per batch.
    The exports, and the one-operator table (so its staircase of fast widths), are timed in
    `form` (fp32, or the quantizer named: the form that will be deployed).
    """
    units = list(units)
    latency = LatencyModel(
        layer_shapes(model, input_shape),
        {n: probe_unit_layers(model, example, n, s, input_shape) for n, s in units},
        table,
        form=form,
    )
    batches = sorted(set(batches))
    started = time.perf_counter()
    for batch in batches:
        for name, _ in units:
            latency.unit_curve(name, batch)  # fills the table on the grid
    table_s, started = time.perf_counter() - started, time.perf_counter()
    points, models = {}, {}
    lean, lean_example = without_vocabulary(model), within_vocabulary(example)
    wanted = _measurement_points(latency, units, batches, unit_points)
    # A twin's one-unit points are timed once, on its representative's export (see `twin_units`).
    shared = shared_points(wanted, twin_units(latency))
    for key, widths in wanted.items():
        twin = None if key in shared else _pruned_or_none(lean, lean_example, widths)
        if twin is not None:
            points[key], models[key] = widths, twin
    # Short runs per model: the fit averages over every export, and there are tens of them. A
    # large batch runs long enough to need fewer (MiniLM: ~100 ms a run at batch 32).
    timings = {
        batch: BenchmarkConfig(
            threads=table.machine["threads"],
            batch_sizes=[batch],
            warmup=3 if batch <= 8 else 1,
            repeats=max(4, 15 // max(1, batch // 8)),
            rounds=2,
        )
        for batch in batches
    }
    measured = measured_latency(models, input_shape, timings, form=form)  # each model exported once
    for key, source in shared.items():
        if source in measured:
            points[key], measured[key] = wanted[key], measured[source]
    by_batch = {batch: {k: t[batch] for k, t in measured.items()} for batch in batches}
    # Where the stage's time went: the table's layer graphs, then the whole-model exports.
    seconds = {
        "table": table_s,
        "exports": time.perf_counter() - started,
        "models": len(models),
        "shared_with_twins": sum(source in measured for source in shared.values()),
    }
    latency.exports = {"points": points, "measured": by_batch, "seconds": seconds, "shared": shared}
    for batch in batches:
        errors = held_out_errors(latency, points, latency.exports["measured"][batch], batch)
        latency.fit_(pick_predictor(errors), batch)
        latency.held_out[batch] = {f: mean_miss(e) for f, e in errors.items()}
    return latency


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


def fit_layer_costs(
    latency: LatencyModel, points: dict[str, dict[str, int]], measured: dict[str, float], feature: str, batch: int
) -> tuple[str, float, dict[str, float]]:
    """Intercept and per-layer cost per unit of `feature`, fitted to measured exports (non-negative least squares).

    In context each layer costs what the whole graph makes it cost (layouts, fusions, per-call
    overhead, the intercept); one coefficient per layer whose feature varies across the points.
    """
    from scipy.optimize import nnls

    values = {
        k: {n: latency.feature(feature, s, batch) for n, s in latency.shapes(w).items()} for k, w in points.items()
    }
    layers = [n for n in latency.base if len({round(v[n], 12) for v in values.values()}) > 1]
    rows = np.array([[1.0, *(values[k][n] for n in layers)] for k in points])
    coef, _ = nnls(rows, np.array([measured[k] for k in points]))
    return feature, float(coef[0]), dict(zip(layers, (float(c) for c in coef[1:]), strict=True))


def _multi_unit(key: str) -> bool:
    """Whether an export key is one of the uniform cuts (every unit narrowed, as a plan narrows them)."""
    return key != "dense" and not key.startswith("unit:")


def held_out_errors(
    latency: LatencyModel, points: dict[str, dict[str, int]], measured: dict[str, float], batch: int
) -> dict[str, list[float]]:
    """Per predictor, its relative miss on each multi-unit cut when fitted on every other export.

    The candidates: per-layer costs on MACs (`mmacs`), on one-operator table times (`table`), or
    one line over the table sum (`line`). Only the uniform cuts are held out because plans narrow
    many units at once: leaving out a one-unit export judges a per-layer fit on the one layer it
    then knows nothing about, which no plan asks.
    """
    held_out = [k for k in points if _multi_unit(k)] or [k for k in points if k != "dense"]
    errors: dict[str, list[float]] = {}
    for feature in PREDICTORS:
        errors[feature] = []
        for out in held_out:
            twin = replace(latency, calibration={}, layer_costs={}, savings_scale={})
            twin.fit_(feature, batch, {k: w for k, w in points.items() if k != out}, measured)
            errors[feature].append(abs(twin.predict(points[out], batch) / measured[out] - 1.0))
    return errors


def mean_miss(errors: list[float]) -> float | None:
    """The mean of one predictor's held-out misses; None when no cut was held out for it."""
    return float(np.mean(errors)) if errors else None


def pick_predictor(errors: dict[str, list[float]]) -> str:
    """The predictor whose mean held-out miss is least (ties, to `MISS_DIGITS` decimals: the least worst miss).

    The mean, not the median: the median of four misses ignores the largest, most often the
    deepest cut's, where latency targets send plans. On a small transformer whose one-operator
    timings are mostly call overhead, a table-sum predictor won on the median in some builds
    while missing the deepest cut by 11 %; MAC costs missed every cut by 6 % at most. Judged on
    random mixed plans timed against dense (10-20 builds each: the digits CNN at batch 1 and 64,
    a small transformer, five families), the mean misses of the mean's choices summed to 23.3 %
    over the eight cases, the median's to 24.8 % and the worst miss's to 23.7 % (worse than the
    median's by 0.7 on one); the mean's was never more than 0.15 worse than the median's.
    """

    def misses(feature: str) -> tuple[float, float]:
        e = errors[feature]
        # Rounded: two predictors that fit the exports equally well differ by float rounding
        # alone (1e-15 here), which then chose between them by CPU; a tie goes to the order of
        # `errors` (PREDICTORS: MAC costs first).
        return (round(mean_miss(e), MISS_DIGITS), round(max(e), MISS_DIGITS)) if e else (np.inf, np.inf)

    return min(errors, key=misses)


VOCABULARY_ROWS = 1024  # rows kept of a token embedding in timing copies (timing feeds use token id 1)


def without_vocabulary(model: nn.Module) -> nn.Module:
    """A copy whose token embeddings keep their first `VOCABULARY_ROWS` rows, for timing only.

    A lookup costs the same whatever the table's size, but tens of timing copies of a text model
    each holding its vocabulary (half of MiniLM's weights) held 14 GB at once. Position and type
    embeddings (fewer rows) are left whole. The model itself is not changed.
    """
    twin = copy.deepcopy(model)
    for module in twin.modules():
        if isinstance(module, nn.Embedding) and module.num_embeddings > VOCABULARY_ROWS:
            module.weight = nn.Parameter(module.weight.detach()[:VOCABULARY_ROWS].clone())
            module.num_embeddings = VOCABULARY_ROWS
    return twin


def within_vocabulary(example):
    """`example` with integer inputs (token ids) folded into the rows `without_vocabulary` keeps.

    Pruning a timing copy runs it on the example; what the tokens are does not matter there.
    """
    if not isinstance(example, dict):
        return example
    return {k: v.remainder(VOCABULARY_ROWS) if not v.is_floating_point() else v for k, v in example.items()}


def _pruned_or_none(model: nn.Module, example: torch.Tensor, widths: dict[str, int]) -> nn.Module | None:
    """A copy pruned to `widths` that still runs; None where a width empties a layer.

    (One side of a concat at a few channels, say: such widths lie beyond what the allocator cuts.)
    """
    twin = copy.deepcopy(model)
    if widths:
        UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_(widths)
    try:
        with torch.no_grad():  # (pruning itself traces with autograd)
            run_model(twin.eval(), example)
    except RuntimeError:
        return None
    return twin


def _measurement_points(
    latency: LatencyModel, units: list[tuple[str, int]], batches: list[int], unit_points: int = UNIT_POINTS
):
    """Widths to export and time: dense, four uniform cuts, every unit alone at a few efficient widths."""
    points: dict[str, dict[str, int]] = {"dense": {}}
    for keep in (0.75, 0.5, 1 / 3, 0.25):
        points[f"keep{keep:.2f}"] = {
            n: min(w for w in latency.efficient_widths(n, batches[0]) if w >= keep * s) for n, s in units
        }
    for name, size in units:
        widths = sorted({w for b in batches for w in latency.efficient_widths(name, b)} - {size})
        for width in _spread(widths, unit_points):
            points[f"unit:{name}:{width}"] = {name: width}
    return points


def twin_units(latency: LatencyModel) -> dict[str, str]:
    """Each unit's representative: the first unit whose width moves layers of the same shapes the same way.

    Two such units (the heads, or the FFN, of every layer of an encoder; the expansions of the
    repeated blocks of one inverted-residual stage) leave the model computing the same shapes at
    the same width, wherever they sit in it, so the whole model with either one narrowed costs the
    same. Timing one stands for both: on MiniLM this turns 48 one-unit exports into 8. A unit
    whose layers differ in any shape, field or change per removed channel is its own twin.
    """
    first: dict[tuple, str] = {}
    out = {}
    for name, unit in latency.units.items():
        signature = (unit.size, tuple((latency.base[layer], f, round(d, 9)) for layer, f, d in unit.deltas))
        out[name] = first.setdefault(signature, name)
    return out


def shared_points(points: dict[str, dict[str, int]], twins: dict[str, str]) -> dict[str, str]:
    """One-unit points of units that are not their own representative -> the representative's point at that width."""
    keys = {(n, w): k for k, widths in points.items() if k.startswith("unit:") for n, w in widths.items()}
    shared = {}
    for (name, width), key in keys.items():
        source = keys.get((twins.get(name, name), width))
        if source is not None and source != key:
            shared[key] = source
    return shared


def _spread(values: list[int], count: int) -> list[int]:
    """At most `count` of `values` (sorted), evenly spaced, the largest included."""
    if len(values) <= count:
        return values
    return sorted({values[round(i * (len(values) - 1) / (count - 1))] for i in range(count)})


def fit_calibration(sums: np.ndarray, measured: np.ndarray) -> tuple[float, float]:
    """`a`, `b` with `measured ~ a + b * sums` (least squares; an offset alone when the sums do not vary)."""
    if np.ptp(sums) < 1e-9:
        return float(np.mean(measured - sums)), 1.0
    b, a = np.polyfit(sums, measured, 1)
    return float(a), float(b)


def keep_counts(ratios: dict[str, float], sizes: dict[str, int]) -> dict[str, int]:
    """Widths that an allocation of ratios gives (as the pruning method rounds them)."""
    return {n: round_keep(sizes[n], r, None) for n, r in ratios.items()}


def informative_points(curve: dict, chance_drop: float | None) -> list[tuple[float, float]]:
    """A unit's measured (ratio, drop) points, (0, 0) first, with the drop made non-decreasing.

    Points whose accuracy fell to chance are left out: at chance every ratio looks alike, so they
    say nothing about how much of the unit can go (the allocator would otherwise cut deepest).
    """
    points, best = [(0.0, 0.0)], 0.0
    for ratio, drop in zip(curve["ratios"], cost_of(curve), strict=True):
        if chance_drop is not None and drop >= chance_drop:
            break
        best = max(best, drop)
        points.append((ratio, best))
    return points


def drop_at(points: list[tuple[float, float]], ratio: float) -> float | None:
    """Interpolated drop at `ratio`; None beyond the last informative point."""
    if ratio <= 0.0:
        return 0.0
    for (r0, d0), (r1, d1) in itertools.pairwise(points):
        if r0 <= ratio <= r1:
            return d0 if r1 == r0 else d0 + (d1 - d0) * (ratio - r0) / (r1 - r0)
    return None


@dataclass(frozen=True)
class LatencyAllocation:
    """Per-unit widths that meet a latency target, their predicted latency and summed isolated drop."""

    widths: dict[str, int]
    ratios: dict[str, float]
    target_ms: float
    batch: int
    predicted_ms: float
    dense_predicted_ms: float
    summed_isolated_drop: float
    steps: int
    reached: bool
    # The least-drop feasible plans, this one first (see `allocate_latency`'s `shortlist`).
    options: tuple[PlanOption, ...] = ()


@dataclass(frozen=True)
class PlanOption:
    """One feasible plan of a latency allocation: widths, predicted ms, summed isolated drop."""

    widths: dict[str, int]
    ratios: dict[str, float]
    predicted_ms: float
    summed_isolated_drop: float
    uniform: bool  # every unit cut alike


def _candidates(latency: LatencyModel, sweep: dict, batch: int, max_ratio: float, chance_drop: float | None):
    """Per unit: the efficient widths it may stop at, each with its interpolated isolated drop."""
    out: dict[str, list[tuple[int, float]]] = {}
    for name, unit in latency.units.items():
        curve = sweep["units"].get(name)
        if curve is None:
            continue
        points = informative_points(curve, chance_drop)
        options = []
        for width in latency.efficient_widths(name, batch):
            ratio = 1.0 - width / unit.size
            drop = drop_at(points, ratio)
            if ratio <= max_ratio + 1e-9 and drop is not None:
                options.append((width, drop))
        out[name] = sorted(options, reverse=True)  # widest first: where every unit starts
    return out


def _descend(latency: LatencyModel, options: dict, target_ms: float, batch: int, leap: bool) -> dict[str, int]:
    """Greedy NetAdapt-style descent: positions (option indices) from full width down to `target_ms`.

    Repeatedly moves the unit whose next efficient width (with `leap`, any narrower one) saves
    the most predicted milliseconds per point of isolated accuracy drop, predicting the whole
    model each time (the layers between two pruned units shrink in both dimensions, which
    per-unit sums would miss). Without `leap` it stops where no next width saves anything.
    """
    position = {n: 0 for n, opts in options.items() if opts}
    widths = {n: options[n][0][0] for n in position}
    current = latency.predict(widths, batch)
    while current > target_ms:
        best = None
        for name, i in position.items():
            # In context the next width may save nothing where a narrower one does.
            js = range(i + 1, len(options[name]) if leap else min(i + 2, len(options[name])))
            moved = latency.predict_moves(widths, name, [options[name][j][0] for j in js], batch)
            for j, ms in zip(js, moved, strict=True):
                drop = options[name][j][1]
                saved = current - ms
                if saved <= 0:
                    continue
                key = (max(drop - options[name][i][1], 0.0) / saved, -saved)
                if best is None or key < best[0]:
                    best = (key, name, j)
        if best is None:
            break
        _, name, j = best
        position[name] = j
        widths[name] = options[name][j][0]
        current = latency.predict(widths, batch)
    return position


def _lagrangian(latency: LatencyModel, options: dict, weight: float, batch: int) -> dict[str, int]:
    """Positions minimising `summed drop + weight * predicted ms` by coordinate descent.

    Unlike the descent, a unit may widen again when others narrow, so it escapes the early
    greedy moves that lock in: on a residual CNN the descent kept a 6-channel layer that a
    near-uniform plan of the same predicted latency avoids at two thirds of the summed drop.
    """
    position = {n: 0 for n, opts in options.items() if opts}
    for _ in range(20):
        changed = False
        for name in position:
            widths = {n: options[n][i][0] for n, i in position.items()}
            moved = latency.predict_moves(widths, name, [width for width, _ in options[name]], batch)
            costs = [drop + weight * ms for (_, drop), ms in zip(options[name], moved, strict=True)]
            best = min(range(len(costs)), key=costs.__getitem__)
            if costs[best] < costs[position[name]] - 1e-12:
                position[name], changed = best, True
        if not changed:
            break
    return position


def _plans_along_weights(latency: LatencyModel, options: dict, target_ms: float, batch: int, dense: float):
    """Lagrangian plans for weights bisected (log scale) towards the smallest one that meets the target."""
    low, high = math.log(1e-4 / dense), math.log(1e4 / dense)
    for _ in range(24):
        middle = (low + high) / 2
        position = _lagrangian(latency, options, math.exp(middle), batch)
        if latency.predict({n: options[n][i][0] for n, i in position.items()}, batch) <= target_ms:
            high = middle
            yield position
        else:
            low = middle


def _uniform_plans(latency: LatencyModel, options: dict):
    """Every unit cut alike: for each kept fraction some unit can stop at, each unit's narrowest option keeping it."""
    sizes = {n: latency.units[n].size for n in options if options[n]}
    for fraction in sorted({w / sizes[n] for n in sizes for w, _ in options[n]}):
        # Options run widest first: the last one still keeping the fraction is the narrowest.
        yield {n: max(i for i, (w, _) in enumerate(options[n]) if w >= fraction * s) for n, s in sizes.items()}


def allocate_latency(
    latency: LatencyModel,
    sweep: dict,
    target_ms: float,
    batch: int,
    max_ratio: float,
    chance_drop: float | None,
    shortlist: int = 1,
) -> LatencyAllocation:
    """Widths meeting `target_ms` (predicted at `batch`) with the least summed isolated accuracy drop.

    Searches over the table's efficient widths, the best kept: the greedy descent step by step
    and leaping (`_descend`), Lagrangian coordinate descent (`_lagrangian`) with its weight
    bisected to the target, and every unit cut alike (`_uniform_plans`); no one of them is best
    on every model (on a residual CNN the descent alone cost a third more summed drop than the
    uniform cut of the same latency, and 2.3 points after fine-tuning). Where no allocation the
    sweep's informative ratios and `max_ratio` allow reaches the target, the fastest plan found
    is kept (`reached` False).

    With `shortlist` above 1, `options` holds up to that many distinct feasible plans predicted
    at `SHORTLIST_FLOOR` of the target or more, least summed drop first (the allocation itself,
    wherever it lands), and the best such uniform one among them: at deep cuts the summed drop (no
    fine-tuning) ranks plans against what fine-tuning recovers, so the caller may rank the
    shortlist by training instead (`pruneops.prune`'s plan trials).
    """
    options = _candidates(latency, sweep, batch, max_ratio, chance_drop)
    dense = latency.predict({}, batch)

    def widths_of(position: dict[str, int]) -> dict[str, int]:
        return {n: options[n][i][0] for n, i in position.items()}

    def summed_drop(position: dict[str, int]) -> float:
        return sum(options[n][i][1] for n, i in position.items())

    plans = [_descend(latency, options, target_ms, batch, leap) for leap in (False, True)]
    plans += list(_plans_along_weights(latency, options, target_ms, batch, dense))
    first_uniform = len(plans)
    plans += list(_uniform_plans(latency, options))  # so that the allocation is never worse than uniform
    predicted = [latency.predict(widths_of(p), batch) for p in plans]
    uniform = [widths_of(p) for p in plans[first_uniform:]]
    # Least summed drop first; ties: the first found.
    feasible = sorted((i for i, ms in enumerate(predicted) if ms <= target_ms), key=lambda i: summed_drop(plans[i]))
    # Beside the least-drop plan, only plans near the target: one far under it is cut deeper than asked.
    near = feasible[:1] + [i for i in feasible[1:] if predicted[i] >= SHORTLIST_FLOOR * target_ms]
    picks = _shortlisted([widths_of(plans[i]) for i in near], uniform, shortlist)
    picks = [near[k] for k in picks] or [min(range(len(plans)), key=predicted.__getitem__)]

    def option(i: int) -> PlanOption:
        widths = widths_of(plans[i])
        ratios = {n: 1.0 - w / latency.units[n].size for n, w in widths.items()}
        return PlanOption(widths, ratios, predicted[i], summed_drop(plans[i]), widths in uniform)

    options = tuple(option(i) for i in picks)
    best = options[0]
    return LatencyAllocation(
        widths={n: w for n, w in best.widths.items() if w < latency.units[n].size},
        ratios=best.ratios,
        target_ms=target_ms,
        batch=batch,
        predicted_ms=best.predicted_ms,
        dense_predicted_ms=dense,
        summed_isolated_drop=best.summed_isolated_drop,
        steps=sum(plans[picks[0]].values()),
        reached=best.predicted_ms <= target_ms,
        options=options,
    )


def _shortlisted(ordered: list[dict[str, int]], uniform: list[dict[str, int]], count: int) -> list[int]:
    """Indices of the first `count` distinct plans of `ordered`, the first uniform one among them."""
    distinct: list[int] = []
    for i, widths in enumerate(ordered):
        if all(widths != ordered[j] for j in distinct):
            distinct.append(i)
    picks = distinct[:count]
    first_uniform = next((i for i in distinct if ordered[i] in uniform), None)
    if count > 1 and first_uniform is not None and first_uniform not in picks:
        picks[-1] = first_uniform
    return picks


@dataclass(frozen=True)
class LatencyReport(StageReport):
    """What the latency stage timed: in which forms, at which batches, how many units and exports.

    `form` is `prune.latency_form` as set; `forms` the forms timed (with `auto`, every form the
    quantize stage may ship, and fp32, the reference of a `latency_ratio`); `screened` the forms
    `auto` left untimed, each with why (`screen_forms`). `reason` says why nothing was timed
    (`measured` false): no latency target, or a method that prunes weights rather than widths.
    """

    measured: bool
    reason: str
    form: str
    forms: tuple[str, ...]
    screened: dict[str, str]
    batches: tuple[int, ...]
    units: int
    exports: int
    table_seconds: float
    export_seconds: float
    machine: str
    out: Path
    # Per form and batch: the predictor chosen and each candidate's mean held-out miss (`pick_predictor`).
    predictors: dict[str, dict[str, dict[str, Any]]] = field(default_factory=dict)

    def summary(self) -> str:
        if not self.measured:
            return f"no latency table: {self.reason}"
        untimed = f" ({', '.join(self.screened)} screened out: slower than fp32)" if self.screened else ""
        return (
            f"{self.units} units timed in {', '.join(self.forms)}{untimed} at batch "
            f"{', '.join(map(str, self.batches))} on {self.machine}: {self.exports} exports, "
            f"{self.table_seconds + self.export_seconds:.0f} s; predicted by {self._predictors_text()} -> {self.out}"
        )

    def _predictors_text(self) -> str:
        """Per form, each batch's predictor and its mean held-out miss: `fp32 b1 mmacs (3%)`."""
        parts = []
        for form, per in self.predictors.items():
            for batch, choice in per.items():
                mean = choice["mean_held_out_error"].get(choice["predictor"])
                miss = f" ({100 * mean:.0f}%)" if mean is not None else ""
                parts.append(f"{form} b{batch} {choice['predictor']}{miss}")
        return ", ".join(parts) or "nothing fitted"


def planned_forms(prune: PruneConfig, quantize: QuantizeConfig) -> list[str]:
    """The forms a latency target is planned in: the one named, or with `auto` each the quantize stage may ship."""
    from pruneops.quantize import QUANTIZERS

    if prune.latency_form != AUTO_FORM:
        return [prune.latency_form]
    return sorted(QUANTIZERS.names()) if quantize.method == "auto" else [quantize.method]


def timed_forms(prune: PruneConfig, quantize: QuantizeConfig) -> list[str]:
    """The forms the latency stage times: those planned in, and fp32 with `auto` (a ratio's reference)."""
    planned = planned_forms(prune, quantize)
    return planned if prune.latency_form != AUTO_FORM else sorted({"fp32", *planned})


# A screened form must be this much slower than fp32 at every point and batch before it is left
# untimed: the screen's runs are short, and a form about as fast as fp32 deserves its own table.
SCREEN_MARGIN = 1.1


def forms_slower_than_fp32(
    medians: dict[str, dict[str, dict[int, float]]], margin: float = SCREEN_MARGIN
) -> dict[str, str]:
    """The forms slower than fp32 by `margin` at every screened point and batch, each with the reason.

    Args:
        medians: Per form (`fp32` among them), per point (`dense`, `quarter`), per batch: ms.
        margin: How much slower than fp32 everywhere a form must be to be left out.
    """
    reference = medians["fp32"]
    cells = [(p, b) for p in reference for b in reference[p]]
    out = {}
    for form, points in medians.items():
        if form != "fp32" and all(points[p][b] > margin * reference[p][b] for p, b in cells):
            shown = ", ".join(f"{p} {points[p][b]:.3g} vs {reference[p][b]:.3g} ms at batch {b}" for p, b in cells)
            out[form] = f"slower than fp32 dense and cut to a quarter ({shown}): no table timed"
    return out


def screen_forms(
    model: nn.Module,
    example: torch.Tensor,
    input_shape,
    units: list[tuple[str, int]],
    threads: int,
    batches: list[int],
    forms: list[str],
) -> tuple[dict[str, str], int]:
    """The INT8 forms not worth a latency table here, each with the reason (`forms_slower_than_fp32`).

    With `prune.latency_form: auto` and `quantize.method: auto`, fp32 is itself a form the
    quantize stage may ship. A form slower than fp32 both dense and with every unit cut to a
    quarter needs deeper cuts (more accuracy lost) for the same milliseconds, and would lose the
    quantize stage's own comparison with fp32; its table (tens of exports; dynamic INT8 runs
    convolutions several times slower than fp32 on AVX2) is not worth timing. Two exports per
    form (one where the quarter-width copy does not run), timed interleaved with fp32's.

    Returns:
        The forms left out, each with why, and how many exports the screen timed.
    """
    lean, lean_example = without_vocabulary(model), within_vocabulary(example)
    quarter = _pruned_or_none(lean, lean_example, {n: round_keep(s, 0.75, 8) for n, s in units})
    points = {"dense": lean, **({"quarter": quarter} if quarter is not None else {})}
    everyone = ["fp32", *forms]
    models = {f"{form}:{p}": m for form in everyone for p, m in points.items()}
    timing = BenchmarkConfig(threads=threads, batch_sizes=batches, warmup=3, repeats=10, rounds=2)
    measured = measured_latency(models, input_shape, timing, form={k: k.split(":")[0] for k in models})
    medians = {form: {p: measured[f"{form}:{p}"] for p in points} for form in everyone}
    return forms_slower_than_fp32(medians), len(models)


def measure_latency_table(
    config: LatencyConfig,
    prune: PruneConfig,
    benchmark: BenchmarkConfig,
    quantize: QuantizeConfig,
    layout: Layout | None = None,
) -> LatencyReport:
    """Times every unit of the baseline model on this machine, for the prune stage's latency target.

    The units are the sensitivity sweep's (their names and sizes); the one-operator table and the
    whole-model exports are timed at `benchmark.threads`, at batch 1 and every benchmark batch
    (so moving the target between them reuses the table), in `prune.latency_form`, or with
    `auto` in each form `timed_forms` names. Without a latency target nothing is timed and
    `skipped.txt` says why.

    Args:
        config: The `latency` section of params.
        prune: The `prune` section: its target says whether to time, its latency form in what.
        benchmark: The `benchmark` section: the thread count and batch sizes latency is timed at.
        quantize: The `quantize` section: the forms it may ship (for `prune.latency_form: auto`).
        layout: Where to read and write; defaults to the current directory.

    Returns:
        The report; per form `artifacts/latency/<form>/latency.json` (the fitted model) and
        `latency_table.json` (the one-operator timings, tagged with the machine),
        `artifacts/latency/forms.json` (the forms to plan in, and the reference), and
        `plots/latency/latency.png` (one panel per form).

    Raises:
        DataError: The sweep is missing, or was made on another model than the one trained.
    """
    layout = layout or Layout()
    torch.set_num_threads(config.threads)
    batches = sorted({1, *benchmark.batch_sizes})
    machine = machine_fingerprint(benchmark.threads)
    sweep = _sweep_of_trained_model(layout)
    reason = _why_no_table(prune, sweep)
    report = LatencyReport(
        measured=not reason,
        reason=reason,
        form=prune.latency_form,
        forms=tuple(timed_forms(prune, quantize)) if not reason else (),
        screened={},
        batches=tuple(batches),
        units=0,
        exports=0,
        table_seconds=0.0,
        export_seconds=0.0,
        machine=machine["cpu"],
        out=layout.stage_dir("latency"),
    )
    if reason:
        _write_latency(layout, {}, [], report)
        return report
    meta, _, val, _ = load_prepared(layout.stage_dir("validate"))
    base = load_checkpoint(layout.stage_dir("train") / "model.safetensors").model
    units = [(n, c["size"]) for n, c in sweep["units"].items()]
    planned = planned_forms(prune, quantize)
    if prune.latency_form == AUTO_FORM and "fp32" in planned and len(planned) > 1:
        started = time.perf_counter()
        others = [f for f in planned if f != "fp32"]
        screened, exports = screen_forms(
            base, head_tensors(val.x), meta.input_shape, units, benchmark.threads, batches, others
        )
        for form, why in screened.items():
            logger.info("latency form %s: %s", form, why)
        planned = [f for f in planned if f not in screened]
        report = replace(
            report,
            forms=tuple(f for f in report.forms if f not in screened),
            screened=screened,
            export_seconds=time.perf_counter() - started,
            exports=exports,
        )
    models = {}
    for form in report.forms:
        logger.info("latency table in %s: %d units at batch %s", form, len(units), ", ".join(map(str, batches)))
        models[form] = build_latency_model(
            base, head_tensors(val.x), meta.input_shape, units, LatencyTable(machine), batches, form, config.unit_points
        )
    seconds = [m.exports.get("seconds", {}) for m in models.values()]
    report = replace(
        report,
        units=len(units),
        # twins share one export (`twin_units`); the screen's exports count too
        exports=report.exports + sum(int(s.get("models", 0)) for s in seconds),
        table_seconds=sum(float(s.get("table", 0.0)) for s in seconds),
        export_seconds=report.export_seconds + sum(float(s.get("exports", 0.0)) for s in seconds),
        predictors={form: _predictor_choices(m) for form, m in models.items()},
    )
    _write_latency(layout, models, planned, report)
    return report


def _predictor_choices(latency: LatencyModel) -> dict[str, dict[str, Any]]:
    """Per batch: the predictor the model fitted and each candidate's mean held-out miss."""
    chosen = {b: costs[0] for b, costs in latency.layer_costs.items()}
    return {
        str(b): {"predictor": chosen.get(b, "line"), "mean_held_out_error": errors}
        for b, errors in sorted(latency.held_out.items())
    }


def _sweep_of_trained_model(layout: Layout) -> dict:
    """The sensitivity sweep, checked to be of the model the train stage wrote."""
    path = layout.stage_dir("sensitivity") / "sensitivity.json"
    try:
        sweep = read_json(path)
    except FileNotFoundError:
        raise DataError(f"{path}: not found; run `pruneops sensitivity` first (its units are what is timed)") from None
    trained = layout.stage_dir("train") / "model.safetensors"
    if sweep.get("model_sha256") != file_sha256(trained):
        raise DataError(f"{path}: swept another model than {trained}; rerun `pruneops sensitivity`")
    return sweep


def _why_no_table(prune: PruneConfig, sweep: dict) -> str:
    """Why there is nothing to time ("" when there is)."""
    if prune.target not in LATENCY_TARGETS:
        return f"prune.target is {prune.target}, not a latency target"
    if sweep.get("granularity") != "units":
        return f"prune.method {prune.method} prunes weights, not widths"
    return ""


def _write_latency(layout: Layout, models: dict[str, LatencyModel], planned: list[str], report: LatencyReport) -> None:
    out_dir, metrics_path, plots_dir = layout.stage_dir("latency"), layout.metrics("latency"), layout.plots("latency")
    with staged_output_paths(out_dir, metrics_path, plots_dir) as staged:
        tmp = staged.dir(out_dir)
        if not models:
            # DVC needs the output to exist; this says what is (not) in it.
            (tmp / "skipped.txt").write_text(f"no latency table: {report.reason}\n")
        else:
            for form, latency in models.items():
                (tmp / form).mkdir()
                dump_json(latency.to_json(), tmp / form / "latency.json")
                latency.table.save(tmp / form / "latency_table.json")
            reference = "fp32" if report.form == AUTO_FORM else report.form
            forms = {"setting": report.form, "planned": planned, "reference": reference, "screened": report.screened}
            dump_json(forms, tmp / FORMS_FILE)
        dump_json(report.metrics(), staged.path(metrics_path))
        # One panel per form, the forms planned in first.
        order = [*planned, *(f for f in models if f not in planned)]
        panels = [_staircases(models[form], 1) for form in order]
        plot_latency_staircases(panels, report.reason, staged.dir(plots_dir) / "latency.png")


def _staircases(latency: LatencyModel, batch: int) -> dict[str, Any]:
    """Per unit at `batch`: predicted whole-model ms with only it at each grid width, and its timed exports.

    A twin's one-unit points carry its representative's times (`shared_points`): the same shapes.
    """
    points, measured = latency.exports.get("points", {}), latency.exports.get("measured", {}).get(batch, {})
    out = {}
    for name, unit in latency.units.items():
        timed = [
            (widths[name], measured[key])
            for key, widths in points.items()
            if key.startswith("unit:") and set(widths) == {name} and key in measured
        ]
        out[name] = {
            "size": unit.size,
            "predicted": [(w, latency.predict({name: w}, batch)) for w in width_grid(unit.size)],
            "efficient": latency.efficient_widths(name, batch),
            "measured": sorted(timed),
        }
    return {"dense_ms": measured.get("dense"), "units": out, "form": latency.form, "batch": batch}
