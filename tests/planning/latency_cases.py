"""Models, sweeps, tables and fake timings shared by the timing, planning and latency-stage tests."""

from __future__ import annotations

import copy
import math

import torch

from pruneops.models import create_model
from pruneops.planning import loop as loop_module
from pruneops.planning import targets as targets_module
from pruneops.planning.latency_model import LatencyModel, probe_unit_layers
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from pruneops.runtimes.onnxruntime.layers import LatencyTable, layer_shapes

SHAPE = [1, 12, 12]


def _units(model, example):
    return {n: u.size for n, u in UnitPruner(model, example, IMPORTANCES.get("l2")).units().items()}


def _latency_model(spec):
    torch.manual_seed(0)  # which side of a concat loses a channel follows the weights
    model = create_model(spec).eval()
    example = torch.zeros(1, *SHAPE)
    sizes = _units(model, example)
    latency = LatencyModel(
        layer_shapes(model, SHAPE),
        {n: probe_unit_layers(model, example, n, s, SHAPE) for n, s in sizes.items()},
        LatencyTable({"threads": 1}),
    )
    return model, example, sizes, latency


def _work(shapes):
    return sum(s.cin // s.groups * s.cout * math.prod(s.kernel) * (math.prod(s.spatial) or 1) for s in shapes.values())


def _staircase(shape, batch):
    """A synthetic machine: channels are computed in blocks of 16, cost grows with both sides."""
    blocks = math.ceil(shape.cout / 16) * math.ceil(shape.cin / shape.groups / 16)
    return 0.001 * blocks * (math.prod(shape.spatial) or 1) * batch


def _sweep(sizes, drops):
    ratios = [0.25, 0.5, 0.75]
    units = {n: {"ratios": ratios, "accuracy_drop": drops(n), "size": s} for n, s in sizes.items()}
    return {"units": units, "weights": dict.fromkeys(sizes, 1.0)}


# The sweep of the residual MNIST CNN of benchmarks/latency.yaml (this machine, 2026-11-23), on
# which the greedy descent alone chose 16/6/9/32 channels at 1.49 summed drop where the uniform
# 16/16/32/32 of the same predicted latency costs 1.12 (and fine-tuned to 2.3 points more).
CNN_SWEEP = {
    "stem.0": [0.0087, 0.2072, 0.6037, 0.7563, 0.8977],
    "stages.0.conv1": [0.0042, 0.0243, 0.3367, 0.4707, 0.6362],
    "stages.1.conv1": [0.0027, 0.0167, 0.044, 0.1023, 0.2658],
    "stages.1.shortcut.0": [0.0225, 0.1237, 0.138, 0.5482, 0.605],
}


def _fake_times(factors, forms=None):
    """`measured_latency` replaced: each candidate's time is dense's times a factor, per batch.

    `forms`, a list, collects the form each call timed in.
    """

    def measured(models, input_shape, timing, budget_s=None, form="fp32"):
        if forms is not None:
            forms.append(form)
        return {
            name: {b: 1.0 if name == "dense" else factors[name][0 if b == 1 else 1] for b in timing.batch_sizes}
            for name in models
        }

    return measured


DECISIONS = {
    "passed": targets_module.GateDecision.PASSED,
    "passed: widths rounded up": targets_module.GateDecision.WIDENED,
    "backed off: widths rounded up": targets_module.GateDecision.BACKED_OFF,
    "refused": targets_module.GateDecision.REFUSED,
}


def _save_tables(latency_dir, *models, planned=None):
    """Writes latency models as the latency stage does: one folder per form, and `forms.json`."""
    import json

    for latency in models:
        (latency_dir / latency.form).mkdir(parents=True)
        (latency_dir / latency.form / "latency.json").write_text(json.dumps(latency.to_json()))
        latency.table.save(latency_dir / latency.form / "latency_table.json")
    forms = planned or [m.form for m in models]
    (latency_dir / "forms.json").write_text(json.dumps({"setting": "x", "planned": forms, "reference": "fp32"}))


def _skewed_machine(latency):
    """Real milliseconds the table gets wrong for one layer: the 1-channel stem conv costs 10x what
    its one-operator timing says (as a first layer can, converting the input's layout), plus a
    floor. A line fitted on uniform cuts, where every layer shrinks together, averages that out
    and mispredicts plans that cut the stem's unit more than the rest."""

    def real(widths):
        shapes = latency.shapes(widths)
        return 0.2 + sum(
            (10.0 if layer == "stem.0" else 1.0) * latency.table.layer_ms(shape, 1) for layer, shape in shapes.items()
        )

    return real


def _pruned_shapes(model, example, widths):
    twin = copy.deepcopy(model)
    UnitPruner(twin, example, IMPORTANCES.get("l2")).prune_to_(widths)
    return sorted(map(repr, layer_shapes(twin, SHAPE).values()))


def _one_unit_loop(monkeypatch, tmp_path, staircase, gate):
    """`LatencyLoop.run` on one 100-channel unit, a latency ratio of 0.5 at batch 1, with
    `staircase` in place of the table's planner and `gate` in place of the measured gate."""
    from pruneops.config import BenchmarkConfig, PruneConfig
    from pruneops.core.io import Layout

    config = PruneConfig(target={"kind": "latency_ratio", "value": 0.5})
    first = staircase(config, None, None, 1)
    benchmark = BenchmarkConfig(batch_sizes=[1])
    # The table and the gate injected (the runoff's timing stays `targets.retime`, which a test may replace).
    loop = loop_module.LatencyLoop(
        config,
        0.5,
        benchmark,
        None,
        Layout(tmp_path),
        None,
        None,
        [1],
        sizes={"u": 100},
        ask=lambda aim, points: staircase(config, None, None, 1, aim_ms=aim, measured=points),
        measure=lambda plan: gate(config, benchmark, None, None, None, plan),
    )
    return _unpacked(loop.run(first, gate(config, None, None, None, None, first)))


def _unpacked(result):
    return result.plan, result.gated, result.records


def _stage_copy(pipeline_dir, root, **sections):
    """`root` with the session pipeline's data, model and sweep, and params updated by `sections`."""
    import shutil

    from tests.conftest import tiny_params, write_params

    for stage in ("validate", "train", "sensitivity"):
        shutil.copytree(pipeline_dir / "artifacts" / stage, root / "artifacts" / stage)
    return write_params(root, tiny_params(**sections))


def _bare_loop(planning, asked):
    """A `LatencyLoop` at batch 1 over no model: for the parts that only read gate results."""
    from pruneops.config import BenchmarkConfig
    from pruneops.core.io import Layout

    bench = BenchmarkConfig(batch_sizes=[1])
    return loop_module.LatencyLoop(planning, asked.target.value, bench, {}, Layout(), None, None, [1], sizes={})


def _staircase_ask(plans: dict[str, float], fallback_aim: float):
    """A table that plans the widest of `plans` (name -> predicted table ms) within the aim, else the narrowest."""
    from pruneops.planning.targets import Plan

    asked = []

    def ask(aim, points):
        aim = fallback_aim if aim is None else aim
        asked.append(aim)
        within = [n for n, ms in plans.items() if ms <= aim]
        name = max(within, key=plans.get) if within else min(plans, key=plans.get)
        return Plan(0.5, ratios={name: 0.5}, predicted_ms=plans[name], dense_predicted_ms=2.0, aim_ms=aim)

    return ask, asked


def _renamed_or_fixed(source, target, rename: str | None = None, batch: int | None = None):
    import onnx

    model = onnx.load(source)
    graph_input = model.graph.input[0]
    if rename is not None:
        old = graph_input.name
        graph_input.name = rename
        for node in model.graph.node:
            node.input[:] = [rename if i == old else i for i in node.input]
    if batch is not None:
        graph_input.type.tensor_type.shape.dim[0].dim_value = batch
    onnx.save(model, target)
    return target
