"""`latency` for a causal LM: uniform shapes timed where the model serves, and the decode and prefill cost models."""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from pruneops.config import BenchmarkConfig, LatencyConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoder_layout import layout_of
from pruneops.models.decoders import load_causal_lm
from pruneops.pipeline.stages import StageReport
from pruneops.planning.decode_cost import shape_of
from pruneops.reports.decoder_plots import plot_cost_model
from pruneops.task.causal_lm.common import (
    COST_FILE,
    COST_KEYS,
    DENSE_KEYS,
    MODEL_DIR,
    fit_costs,
    read_runtimes,
    time_shapes,
)
from pruneops.timing.machine import machine_info


@dataclass(frozen=True)
class DecodeCostReport(StageReport):
    """The decode and prefill cost models fitted on shapes timed on this machine."""

    dense_tpot_ms: float
    intercept_ms: float
    slope_ms: float
    residual_ms: float
    untouchable_share: float
    dense_ttft_ms: float
    prefill_residual_ms: float
    prefill_untouchable_share: float
    shapes_timed: int

    def summary(self) -> str:
        return (
            f"decode cost: dense {self.dense_tpot_ms:.2f} ms/token, fit residual {self.residual_ms:.2f} ms on "
            f"{self.shapes_timed} shapes; {100 * self.untouchable_share:.0f} % of it no layer cut removes "
            f"(first token: {self.dense_ttft_ms:.1f} ms, residual {self.prefill_residual_ms:.2f} ms, "
            f"{100 * self.prefill_untouchable_share:.0f} % untouchable)"
        )


def decode_cost_table(config: LatencyConfig, benchmark: BenchmarkConfig, layout: Layout) -> DecodeCostReport:
    """Times uniform shapes of the adopted decoder (fp32, batch 1, in `train`'s planning runtime) and fits the costs.

    Timed at `benchmark.threads` after a `benchmark.prompt_length`-token prompt over
    `benchmark.new_tokens` tokens, `benchmark.rounds` interleaved rounds; one cost model per
    metric (`decode`: time per output token, `prefill`: time to first token). Writes
    `artifacts/latency/decode_cost.json` (the fits, every timed shape, the machine) and a plot.
    """
    torch.set_num_threads(config.threads)
    dense, tokenizer = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    layout_of(dense)  # run on its own, the stage refuses what cannot be cut before timing anything
    base = shape_of(dense.config)
    runtime = read_runtimes(layout).planning
    with tempfile.TemporaryDirectory(prefix="pruneops-decode-table-") as work:
        table = time_shapes(
            dense,
            tokenizer,
            Path(work),
            max_layers_dropped=max(2, base.layers // 2),
            prompt_length=benchmark.prompt_length,
            new_tokens=benchmark.new_tokens,
            rounds=benchmark.rounds,
            threads=benchmark.threads,
            seed=0,
            runtime=runtime,
        )
    costs = fit_costs(table)
    rows = [
        {
            "shape": s.describe(),
            "layout": asdict(s),
            "tpot_ms": t.tpot_ms,
            "predicted_ms": costs["decode"].predict(s),
            "ttft_ms": t.ttft_ms,
            "predicted_ttft_ms": costs["prefill"].predict(s),
        }
        for s, t in table
    ]
    out, plots = layout.stage_dir("latency"), layout.plots("latency")
    dense_timing = table[0][1]
    report = DecodeCostReport(
        dense_tpot_ms=dense_timing.tpot_ms,
        intercept_ms=costs["decode"].intercept_ms,
        slope_ms=costs["decode"].slope_ms,
        residual_ms=costs["decode"].residual_ms,
        untouchable_share=costs["decode"].untouchable_share(base),
        dense_ttft_ms=dense_timing.ttft_ms,
        prefill_residual_ms=costs["prefill"].residual_ms,
        prefill_untouchable_share=costs["prefill"].untouchable_share(base),
        shapes_timed=len(table),
    )
    with staged_output_paths(out, layout.metrics("latency"), plots) as staged:
        record = {
            **{COST_KEYS[m]: asdict(c) for m, c in costs.items()},
            **{DENSE_KEYS[m]: dense_timing.milliseconds(m) for m in costs},
            "table": rows,
        }
        dump_json({**record, "machine": machine_info(benchmark.threads, runtime.name)}, staged.dir(out) / COST_FILE)
        plot_cost_model(rows, staged.dir(plots) / "latency.png")
        dump_json(report.metrics(), staged.path(layout.metrics("latency")))
    return report
