"""`latency` stage: the latency model of the trained model on the machine that will serve.

For latency targets only. Every Conv and Linear layer is timed alone in ONNX Runtime
(`pruneops.runtimes.onnxruntime.layers`), the model itself is exported and timed at uniform cuts and per-unit
widths, and the predictor per batch size is chosen on held-out cuts
(`pruneops.planning.latency_model`); one model per form the prune stage plans in
(`pruneops.planning.forms`). Other targets write `skipped.txt` saying why.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from pruneops.config import AUTO_FORM, BenchmarkConfig, LatencyConfig, PruneConfig, QuantizeConfig
from pruneops.core.errors import DataError
from pruneops.core.inputs import head_tensors
from pruneops.core.integrity import file_sha256
from pruneops.core.io import Layout, dump_json, read_json, staged_output_paths
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.pipeline.stages import StageReport
from pruneops.planning.forms import FORMS_FILE, planned_forms, screen_forms, timed_forms
from pruneops.planning.latency_model import LatencyModel, build_latency_model
from pruneops.reports.plots import plot_latency_staircases
from pruneops.runtimes.onnxruntime.layers import LatencyTable, width_grid
from pruneops.timing.machine import machine_fingerprint

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class LatencyReport(StageReport):
    """What the latency stage timed: in which forms, at which batches, how many units and exports.

    `form` is `prune.target.form` as set; `forms` the forms timed (with `auto`, every form the
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
    (so moving the target between them reuses the table), in `prune.target.form`, or with
    `auto` in each form `timed_forms` names. Without a latency target nothing is timed and
    `skipped.txt` says why.

    Args:
        config: The `latency` section of params.
        prune: The `prune` section: its target says whether to time, its latency form in what.
        benchmark: The `benchmark` section: the thread count and batch sizes latency is timed at.
        quantize: The `quantize` section: the forms it may ship (for `prune.target.form: auto`).
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
    if not prune.latency_target:
        return f"prune.target.kind is {prune.target_kind}, not a latency target"
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
