"""`pruneops bench` for causal LMs: the variants' exported decoders timed interleaved and scored by their own logits.

Each variant is the pipeline run as a DVC experiment (`pruneops.compare.run`); its export's
manifest names the decoders it produced (dense fp32 and what a dense variant ships; pruned fp32
and what a pruned variant ships). They are all timed in one process through the runtime that
exported them, round by round at each batch size, and scored on the workload's validation, test
and general-text blocks, each change paired against dense fp32 on the same blocks.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.core.io import Layout, read_json
from pruneops.core.quality import QualityBudget, QualityChange, perplexity_change
from pruneops.runtimes import get_runtime
from pruneops.timing.generation import DecodeWorkload

if TYPE_CHECKING:
    from pruneops.compare.workloads import VariantConfig, WorkloadConfig

SPLITS = ("val", "test", "general")


def decoder_rows(variant: VariantConfig, directory: Path) -> list[dict]:
    """A variant's rows: dense fp32 and what it ships (a dense variant), or pruned fp32 and what it ships."""
    export = Layout(directory).stage_dir("export")
    manifest = read_json(export / "manifest.json")
    metrics = read_json(directory / "metrics.json")
    prune = metrics.get("prune", {})
    keys = ("dense_fp32", "pruned_deployed") if variant.kind == "dense" else ("pruned_fp32", "pruned_deployed")
    rows = []
    for key in keys:
        m = manifest["models"][key]
        deployed = key == "pruned_deployed"
        vocabulary = m.get("vocabulary") if deployed else None
        shape = prune.get("shape", "") + (f", vocabulary {vocabulary}" if vocabulary else "")
        rows.append(
            {
                "name": f"{variant.name} {'deployed' if deployed else 'fp32'}",
                "deployed": deployed,
                "variant": variant.name,
                "family": variant.family,
                "label": variant.label or variant.name,
                "precision": m["precision"],
                "source": m.get("source", "pruned") if deployed else ("dense" if key.startswith("dense") else "pruned"),
                "shape": shape,
                "runtime": manifest["runtime"],
                "path": str(export / m["file"]),
                "predicted_tpot_b1_ms": prune.get("predicted_ms") if key == "pruned_fp32" else None,
            }
        )
    return rows


def measure_decoder_workload(
    work: Path, workload: WorkloadConfig, dirs: dict[str, Path], timing: BenchmarkConfig
) -> tuple[list[dict], list[dict]]:
    """Times every variant's decoders interleaved and scores them; (rows, []) (no latency-table predictions)."""
    first = next(iter(dirs.values()), None)
    if first is None:
        return [], []
    with np.load(Layout(first).stage_dir("validate") / "corpus.npz") as npz:
        blocks = {s: npz[s].astype(np.int64) for s in SPLITS if s in npz}
    rows = [r for v in workload.variants if v.name in dirs for r in decoder_rows(v, dirs[v.name])]
    runtime = get_runtime(rows[0]["runtime"])
    folders = {r["name"]: Path(r["path"]) for r in rows}
    vocab = runtime.open(next(iter(folders.values()))).vocab_size
    rng = np.random.default_rng(0)
    for batch in sorted({1, *timing.batch_sizes}):
        prompt = rng.integers(0, vocab, (batch, timing.prompt_length))
        timed = runtime.time(folders, DecodeWorkload(prompt, timing.new_tokens, timing.rounds))
        for r in rows:
            r[f"ttft_b{batch}_ms"], r[f"tpot_b{batch}_ms"] = timed[r["name"]].ttft_ms, timed[r["name"]].tpot_ms
    losses = {
        r["name"]: {s: runtime.open(folders[r["name"]], threads=2).losses(b) for s, b in blocks.items()} for r in rows
    }
    dense = next(r for r in rows if r["family"] == "dense" and r["precision"] == "fp32")
    quantised = next((r for r in rows if r["family"] == "dense" and r["deployed"]), dense)
    for r in rows:
        for split in blocks:
            nll = losses[r["name"]][split]
            r[f"{split}_perplexity"] = float(math.exp(nll.mean()))
            r[f"{split}_change"] = perplexity_change(nll, losses[dense["name"]][split]).record()
        r["speedup_b1"] = dense["tpot_b1_ms"] / r["tpot_b1_ms"]
        r["speedup_b1_vs_dense_deployed"] = quantised["tpot_b1_ms"] / r["tpot_b1_ms"]
        r["size_bytes"] = sum(p.stat().st_size for p in runtime.files(folders[r["name"]]))
        r["size_reduction"] = _size(dense, runtime) / r["size_bytes"]
    for r in rows:
        r["paired_against"] = {
            o["name"]: perplexity_change(losses[r["name"]]["test"], losses[o["name"]]["test"]).record()
            for o in rows
            if o["family"] not in ("ours", "dense")
            and r["family"] == "ours"
            and not r["deployed"]
            and not o["deployed"]  # the cuts themselves, both in fp32
        }
    return rows, []


def _size(row: dict, runtime) -> int:
    return row.get("size_bytes") or sum(p.stat().st_size for p in runtime.files(Path(row["path"])))


def select_decoder(rows: list[dict], budget: float) -> dict | None:
    """Our fastest decoder per output token whose validation perplexity holds the budget at its interval's far end."""
    held = QualityBudget(budget, "perplexity")
    ours = [r for r in rows if r["family"] == "ours" and held.holds(QualityChange(**r["val_change"]))]
    return min(ours, key=lambda r: r["tpot_b1_ms"]) if ours else None
