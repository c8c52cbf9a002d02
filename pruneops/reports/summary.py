"""One benchmark shape for every task: the headline a stage reports, flows publish and `pruneops bench` reads.

Every benchmark compares what ships with dense: its speed-up against dense fp32 and against dense
in the same precision (what quantisation alone gives), its quality change against dense fp32 on
test with the paired 95 % interval, and its size. `models` has one row per model timed
(`dense_fp32`, `dense_deployed` where the shipped precision is not fp32, `pruned_fp32`,
`pruned_deployed`), each with `precision`, `latency_b1_ms`, `speedup_b1`, `quality` and `size_bytes`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from pruneops.core.quality import DenseShips, ModelSource, QualityChange
from pruneops.pipeline.stages import StageReport

Column = tuple[str, Callable[[dict], str]]
ROW_ORDER = ("dense_fp32", "dense_deployed", "dense_fastest", "pruned_fp32", "pruned_deployed")


@dataclass(frozen=True)
class BenchmarkSummary(StageReport):
    """The headline of a benchmark, the same fields for a classifier and a causal LM.

    `latency_metric` names the time compared (`batch-1 latency`, or `time per output token` at
    batch 1); `quality_metric` the quality (`test accuracy`, `test perplexity`); `quality_change`
    is a `QualityChange` record (accuracy points, or relative perplexity). `source` says whose model ships:
    the pruned one, or dense's (`dense_ships` says why).
    """

    task: str
    shipped: str
    source: ModelSource
    precision: str
    latency_metric: str
    latency_b1_ms: float
    dense_latency_b1_ms: float
    speedup_b1: float
    speedup_b1_same_precision: float
    quality_metric: str
    quality: float
    dense_quality: float
    quality_change: dict
    size_reduction: float
    models: dict
    machine: dict
    # Dense's fastest form within the budgets, what a user gets without pruning: its row (None: none
    # within them), what ships against it at batch 1, and why dense ships where it does.
    fastest_dense: str | None = field(default=None, kw_only=True)
    speedup_b1_vs_fastest_dense: float | None = field(default=None, kw_only=True)
    dense_ships: str | None = field(default=None, kw_only=True)  # quantize's `DenseShips` value

    def headline(self) -> str:
        """One line: speed-ups, the quality change with its interval, size."""
        change = QualityChange(**self.quality_change).text()
        return (
            f"{self.shipped}: {self.speedup_b1:.2f}x dense fp32 ({self.speedup_b1_same_precision:.2f}x dense "
            f"{self.precision}) in {self.latency_metric}, {self.quality_metric} {change} against dense, "
            f"{self.size_reduction:.2f}x smaller"
        )


def ordered(models: dict[str, dict]) -> list[tuple[str, dict]]:
    """The rows in the order every report lists them (dense first, what ships last)."""
    return sorted(models.items(), key=lambda kv: ROW_ORDER.index(kv[0]) if kv[0] in ROW_ORDER else len(ROW_ORDER))


def summary_markdown(bench: dict[str, Any], where: str) -> str:
    """A benchmark's metrics (`BenchmarkSummary` fields) as markdown: the headline and one row per model."""
    change = QualityChange(**bench["quality_change"])
    unit = "%" if bench["quality_metric"].endswith("accuracy") else ""
    scale = 100 if unit else 1
    rows = [
        {
            "name": name,
            **m,
            "quality_text": f"{scale * m['quality']:.2f}{unit}",
        }
        for name, m in ordered(bench["models"])
    ]
    table = render_table(
        rows,
        [
            ("model", lambda r: f"{r['name']} ({r['precision']})"),
            (bench["quality_metric"], lambda r: r["quality_text"]),
            ("size (KiB)", lambda r: f"{r['size_bytes'] / 1024:,.1f}"),
            (f"{bench['latency_metric']} (ms)", lambda r: f"{r['latency_b1_ms']:.4g}"),
            ("speed-up", lambda r: f"{r['speedup_b1']:.2f}x"),
        ],
    )
    why = f"dense: {DenseShips(bench['dense_ships']).why}" if bench.get("dense_ships") else ""
    shipped = bench["shipped"] + (
        f" ({why or 'the quality budget backed off to dense'})" if bench["source"] == ModelSource.DENSE else ""
    )
    fastest = bench.get("fastest_dense")  # named where it is neither of the two rows the line gives
    against = (
        f" ({bench['speedup_b1_vs_fastest_dense']:.2f}x dense's fastest form within the budget, "
        f"{bench['models'][fastest]['precision']})"
        if fastest == "dense_fastest"
        else ""
    )
    return (
        f"# PruneOps pipeline run ({where})\n\n"
        f"Ships **{shipped}**: {bench['speedup_b1']:.2f}x dense fp32 and {bench['speedup_b1_same_precision']:.2f}x "
        f"dense {bench['precision']} in {bench['latency_metric']}{against}; {bench['quality_metric']} {change.text()} "
        f"against dense fp32 (paired 95 % interval); {bench['size_reduction']:.2f}x smaller; on "
        f"{bench['machine']['cpu']}.\n\n" + table
    )


def latency_summary(samples_ms: np.ndarray, batch: int) -> dict[str, float]:
    """Percentiles, mean and throughput of one model's latency samples at one batch size."""
    t = np.asarray(samples_ms)
    return {
        "p50_ms": float(np.percentile(t, 50)),
        "p95_ms": float(np.percentile(t, 95)),
        "p99_ms": float(np.percentile(t, 99)),
        "mean_ms": float(t.mean()),
        "throughput": float(batch / (t.mean() / 1e3)),
    }


def render_table(rows: list[dict], columns: list[Column]) -> str:
    """A markdown table: one row per item, each column a (header, formatter) pair."""
    lines = ["| " + " | ".join(h for h, _ in columns) + " |", "|" + "---|" * len(columns)]
    lines += ["| " + " | ".join(fmt(r) for _, fmt in columns) + " |" for r in rows]
    return "\n".join(lines) + "\n"


def latency_columns(batch_sizes: list[int], digits: int = 4) -> list[Column]:
    """p50/p99 per batch size, then the largest batch's throughput."""
    cols: list[Column] = []
    for b in batch_sizes:
        cols.append((f"b{b} p50 / p99 (ms)", lambda r, b=b: _p50_p99(r["latency"][str(b)], digits)))
    big = str(max(batch_sizes))
    cols.append((f"b{big} throughput (/s)", lambda r: f"{r['latency'][big]['throughput']:,.0f}"))
    return cols


def _p50_p99(lat: dict, digits: int) -> str:
    return f"{lat['p50_ms']:.{digits}f} / {lat['p99_ms']:.{digits}f}"


def speedup_against(models: dict[str, dict], row: str | None) -> float | None:
    """What ships (`pruned_deployed`) against `row` in the latency compared at batch 1 (None: no such row)."""
    return None if row is None else models[row]["latency_b1_ms"] / models["pruned_deployed"]["latency_b1_ms"]
