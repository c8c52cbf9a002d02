"""`pruneops bench` for causal LMs: the variants' exported decoders timed interleaved and scored by their own logits.

Each variant is the pipeline run as a DVC experiment (`pruneops.compare.run`); its export's
manifest names the decoders it produced (dense fp32, what a dense variant ships and the fastest
dense form within the budgets, e.g. llama.cpp's Q4_K_M; pruned fp32 and what a pruned variant
ships). They are all timed in one process, each through the runtime that exported it, round by
round at each batch size (a runtime that times fewer sequences at once sits a batch out), and
scored on the workload's validation, test and general-text blocks and on its zero-shot check's
reported half (`validate.zero_shot`), each change paired against dense fp32 on the same blocks.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.core.integrity import folder_manifest
from pruneops.core.io import Layout, read_json
from pruneops.core.quality import ModelSource, QualityBudget, QualityChange, perplexity_change
from pruneops.data.zero_shot import read_zero_shot
from pruneops.runtimes import get_runtime
from pruneops.task.causal_lm.rows import quality_figures, score_rows, time_rows

if TYPE_CHECKING:
    from pruneops.compare.workloads import VariantConfig, WorkloadConfig

SPLITS = ("val", "test", "general")


def decoder_rows(variant: VariantConfig, directory: Path) -> list[dict]:
    """A variant's rows: dense fp32, what it ships and the fastest dense form; or pruned fp32 and what it ships.

    The fastest dense form within the budgets (the manifest's `fastest_dense`: what a user who never
    pruned would deploy, e.g. llama.cpp's Q4_K_M) is a row of the dense variant unless it is the very
    files of one already (then that row is marked `fastest_dense`); each row names its runtime.
    """
    export = Layout(directory).stage_dir("export")
    manifest = read_json(export / "manifest.json")
    metrics = read_json(directory / "metrics.json")
    prune, quantize = metrics.get("prune", {}), metrics.get("quantize", {})
    keys = ("dense_fp32", "pruned_deployed") if variant.kind == "dense" else ("pruned_fp32", "pruned_deployed")
    fastest = manifest.get("fastest_dense") if variant.kind == "dense" else None
    content = {k: (m.get("runtime", manifest["runtime"]), folder_manifest(export / m["file"]))
               for k, m in manifest["models"].items() if fastest and k in {*keys, fastest}}  # fmt: skip
    fastest_key = next((k for k in keys if fastest and content[k] == content[fastest]), fastest)
    rows = []
    for key in dict.fromkeys((*keys, fastest_key) if fastest_key else keys):
        m = manifest["models"][key]
        deployed = key == "pruned_deployed"
        vocabulary = m.get("vocabulary") if deployed else None
        role = "deployed" if deployed else ("fp32" if key in keys else "fastest")
        rows.append(
            {
                "name": f"{variant.name} {role}",
                "deployed": deployed,
                "variant": variant.name,
                "family": variant.family,
                "label": variant.label or variant.name,
                "precision": m["precision"],
                "source": ModelSource.read(m.get("source")) if deployed else _source(key),
                "dense_ships": m.get("dense_ships") if deployed else None,  # why dense ships where it backed off
                "shape": prune.get("shape", "") + (f", vocabulary {vocabulary}" if vocabulary else ""),
                "runtime": m.get("runtime", manifest["runtime"]),
                "path": str(export / m["file"]),
                "predicted_tpot_b1_ms": prune.get("predicted_ms") if key == "pruned_fp32" else None,
                "fastest_dense": key == fastest_key,
                **(gating_changes(quantize, key) if variant.kind != "dense" else {}),
            }
        )
    return rows


def _source(key: str) -> ModelSource:
    """Whose model a row other than the deployed one holds, by its manifest key (`dense_fp32`, `pruned_fp32`, ...)."""
    return ModelSource.DENSE if key.startswith("dense") else ModelSource.PRUNED


GATING = {"general_change": "general_val_change", "zero_shot_change": "zero_shot_val_change"}


def gating_changes(quantize: dict, key: str) -> dict[str, dict]:
    """A pruned variant's row's changes on general text's and the zero-shot check's gating halves.

    As its quantize stage measured them against dense fp32 (`general_val_change`,
    `zero_shot_val_change`), for what ships (`pruned_deployed`) and the recovered model in fp32
    (`pruned_fp32`); the row's own `general_change` and `zero_shot_change` are on the reported halves.
    """
    if key == "pruned_deployed":
        record = quantize
    else:  # fp32 of the recovered model: a candidate, named so beside dense's where dense shipped
        fp32 = "fp32" if ModelSource.read(quantize.get("source")) is ModelSource.PRUNED else "pruned fp32"
        record = quantize.get("candidates", {}).get(fp32, {})
    return {gating: record[change] for change, gating in GATING.items() if record.get(change)}


def selection_budgets(workload: WorkloadConfig) -> dict[str, QualityBudget]:
    """Each row key a selected decoder is held on -> its budget: validation, and the gating halves beyond it."""
    return {
        "val_change": QualityBudget(workload.max_perplexity_increase, "perplexity"),
        "general_val_change": QualityBudget(workload.max_general_perplexity_increase, "perplexity"),
        "zero_shot_val_change": QualityBudget(workload.max_zero_shot_drop, "points"),
    }


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
    models = {r["name"]: (get_runtime(r["runtime"]), Path(r["path"])) for r in rows}
    timed = time_rows(models, timing)
    scores = score_rows(models, blocks, read_zero_shot(Layout(first).stage_dir("validate")), "bench")
    dense = next(r for r in rows if r["family"] == "dense" and r["precision"] == "fp32")
    quality = quality_figures(scores, dense["name"])
    for r in rows:
        r.update(timed[r["name"]], **quality[r["name"]])
    quantised = next((r for r in rows if r["family"] == "dense" and r["deployed"]), dense)
    fastest = next((r for r in rows if r["fastest_dense"]), None)
    sizes = {name: sum(p.stat().st_size for p in runtime.files(folder)) for name, (runtime, folder) in models.items()}
    for r in rows:
        r["speedup_b1"] = dense["tpot_b1_ms"] / r["tpot_b1_ms"]
        r["speedup_b1_vs_dense_deployed"] = quantised["tpot_b1_ms"] / r["tpot_b1_ms"]
        r["speedup_b1_vs_fastest_dense"] = fastest["tpot_b1_ms"] / r["tpot_b1_ms"] if fastest else None
        r["size_bytes"] = sizes[r["name"]]
        r["size_reduction"] = sizes[dense["name"]] / r["size_bytes"]
    losses = {name: s.losses for name, s in scores.items()}
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


def select_decoder(rows: list[dict], budgets: dict[str, QualityBudget]) -> dict | None:
    """Our fastest decoder per output token that holds every budget at its interval's far end.

    `budgets` (`selection_budgets`): validation perplexity, and where the row has them, general
    text's and the zero-shot check's gating halves; a row without a figure is not held on it.
    """

    def held(row: dict) -> bool:
        return all(b.holds(QualityChange(**row[k])) for k, b in budgets.items() if row.get(k) is not None)

    ours = [r for r in rows if r["family"] == "ours" and held(r)]
    return min(ours, key=lambda r: r["tpot_b1_ms"]) if ours else None
