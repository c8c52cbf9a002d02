"""The forms a latency target is planned in (fp32, static or dynamic INT8).

Also the screen that drops forms measured slower than fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from pruneops.config import AUTO_FORM, BenchmarkConfig, PruneConfig, QuantizeConfig
from pruneops.planning.latency_model import pruned_or_none, within_vocabulary, without_vocabulary
from pruneops.pruning.units import round_keep
from pruneops.runtimes.onnxruntime.timing import measured_latency

FORMS_FILE = "forms.json"  # in artifacts/latency: the forms to plan in and a ratio's reference


def planned_forms(prune: PruneConfig, quantize: QuantizeConfig) -> list[str]:
    """The forms a latency target is planned in: the one named, or with `auto` each the quantize stage may ship."""
    from pruneops.runtimes.onnxruntime.quantizers import QUANTIZERS

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

    With `prune.target.form: auto` and `quantize.method: auto`, fp32 is itself a form the
    quantize stage may ship. A form slower than fp32 both dense and with every unit cut to a
    quarter needs deeper cuts (more accuracy lost) for the same milliseconds, and would lose the
    quantize stage's own comparison with fp32; its table (tens of exports; dynamic INT8 runs
    convolutions several times slower than fp32 on AVX2) is not worth timing. Two exports per
    form (one where the quarter-width copy does not run), timed interleaved with fp32's.

    Returns:
        The forms left out, each with why, and how many exports the screen timed.
    """
    lean, lean_example = without_vocabulary(model), within_vocabulary(example)
    quarter = pruned_or_none(lean, lean_example, {n: round_keep(s, 0.75, 8) for n, s in units})
    points = {"dense": lean, **({"quarter": quarter} if quarter is not None else {})}
    everyone = ["fp32", *forms]
    models = {f"{form}:{p}": m for form in everyone for p, m in points.items()}
    timing = BenchmarkConfig(threads=threads, batch_sizes=batches, warmup=3, repeats=10, rounds=2)
    measured = measured_latency(models, input_shape, timing, form={k: k.split(":")[0] for k in models})
    medians = {form: {p: measured[f"{form}:{p}"] for p in points} for form in everyone}
    return forms_slower_than_fp32(medians), len(models)
