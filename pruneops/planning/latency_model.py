"""The latency model: a pruned model's milliseconds predicted from measurements on this machine.

Every Conv and Linear layer is timed alone (`pruneops.runtimes.onnxruntime.layers`); one-operator timings miss
what the whole graph does (layout conversions, fusions, per-call cost that dominate at tens of
microseconds), so the model itself is also exported and timed: dense, four uniform cuts, and each
unit alone at a few of its efficient widths. A prediction is `a + sum over layers of (in-context
cost per unit of a feature) * feature`, the feature being the layer's MACs or its table time,
fitted to those exports (non-negative least squares); the feature, or the plain line
`a + b * sum(layer times)`, is chosen per batch size by its error on uniform cuts left out of the
fit. Widths at which a unit's layers are no faster than at a larger width (ONNX Runtime computes
channels in blocks of 8 or 16) are not "efficient": the allocator only stops units at efficient
widths.
"""

from __future__ import annotations

import copy
import time
from collections.abc import Iterable
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np
import torch
from torch import nn

from pruneops.config import BenchmarkConfig
from pruneops.core.inputs import run_model
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner, is_head_unit, round_keep
from pruneops.runtimes.onnxruntime.layers import FIELDS, LatencyTable, LayerShape, layer_mmacs, layer_shapes, width_grid
from pruneops.runtimes.onnxruntime.timing import measured_latency

UNIT_POINTS = 4  # default exports per unit alone (`latency.unit_points`): each costs an export and a timed session

PREDICTORS = ("mmacs", "table", "line")  # per-layer costs on MACs or table times; one line over the table sum

MISS_DIGITS = 9  # held-out relative misses equal to this many decimals are a tie (`pick_predictor`)


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
        per-head attention between them (docs/explanation/latency-targets.md#heads).
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
        twin = None if key in shared else pruned_or_none(lean, lean_example, widths)
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


def pruned_or_none(model: nn.Module, example: torch.Tensor, widths: dict[str, int]) -> nn.Module | None:
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
