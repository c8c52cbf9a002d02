"""`pruneops bench` on a causal LM: variants as DVC experiments of the real stages, baselines chosen in params."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

from pruneops.cli import main  # noqa: E402
from pruneops.compare.results import read_results  # noqa: E402
from tests.decoder_helpers import decoder_params, save_tiny, speeches  # noqa: E402

pytestmark = pytest.mark.slow(reason="four variants of a tiny decoder, each the pipeline as a DVC experiment")


def _bench(root: Path) -> dict:
    save_tiny("llama", root / "model")
    (root / "corpus.txt").write_text("\n\n".join(speeches(80)))
    (root / "general.txt").write_text("\n\n".join(speeches(20, seed=5)))
    params = decoder_params(Path("model"), Path("corpus.txt"), validate={"general_text": "general.txt"})
    baseline = {"finetune.max_tokens": 0}
    return {
        "work_dir": "work",
        "out_dir": "docs/results/llm",
        "timing": {"threads": 1, "batch_sizes": [1, 2], "rounds": 1, "prompt_length": 16, "new_tokens": 4},
        "workloads": [
            {
                "name": "tiny-llama",
                "max_perplexity_increase": 100.0,
                "max_general_perplexity_increase": 100.0,  # a tiny random model: any cut forgets general text
                "params": params,
                "variants": [
                    {"name": "dense", "kind": "dense", "family": "dense"},
                    {"name": "ours", "label": "ours 0.8"},
                    {
                        "name": "width",
                        "family": "torch_pruning",
                        "set": {**baseline, "prune.decoder.strategy": "uniform_width"},
                    },
                    {"name": "depth", "family": "shortgpt", "set": {**baseline, "prune.decoder.strategy": "depth"}},
                ],  # fmt: skip
            }
        ],
    }


def test_a_decoder_workload_is_benchmarked_over_the_pipeline(tmp_path, capsys):
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(_bench(tmp_path)))
    assert main(["--root", str(tmp_path), "bench", "--config", str(tmp_path / "bench.yaml")]) == 0
    here = tmp_path / "docs/results/llm/tiny-llama"
    results = json.loads((here / "results.json").read_text())
    assert results["failed"] == {}, results["failed"]
    rows = {r["name"]: r for r in results["rows"]}
    assert set(rows) == {f"{v} {k}" for v in ("ours", "width", "depth") for k in ("fp32", "deployed")} | {
        "dense fp32",
        "dense deployed",
    }
    dense = rows["dense fp32"]
    assert dense["test_change"]["value"] == 0.0 and dense["speedup_b1"] == 1.0
    for row in rows.values():  # every row timed at both batches and scored on every split
        assert row["tpot_b1_ms"] > 0 and row["tpot_b2_ms"] > 0 and row["general_perplexity"] > 1.0
        change = row["test_change"]
        assert change["low"] <= change["value"] <= change["high"]
    # The baselines are what their strategies cut: every layer kept (width), widths kept (depth).
    assert rows["width fp32"]["shape"].startswith("4 layers") and "MLP 48" in rows["depth fp32"]["shape"]
    assert "ours 0.8 fp32 / width fp32" in (here / "report.md").read_text()
    # What quantisation alone gives: every form dense's quantize stage measured, against its fp32 there.
    forms = {f["name"]: f for f in results["dense_forms"]}
    assert forms["fp32"]["speedup_b1"] == 1.0 and sum(f["shipped"] for f in forms.values()) == 1
    assert "What quantisation alone gives" in (here / "report.md").read_text()
    pick = results["decoder_selected"]
    assert pick is not None and pick["name"].startswith("ours ")
    listed = next(r for r in read_results(tmp_path / "docs") if r.workload == "tiny-llama")
    # The results page lists the pick with its row's speed-up against dense as deployed (6d5ea55) and
    # its row's changes beyond the corpus: general text (set here) and zero-shot (where it is set).
    row = rows[pick["name"]]
    beyond = {k: row[k] for k in ("general_change", "zero_shot_change") if row.get(k)}
    assert "general_change" in beyond
    # ... and against the fastest dense form within the budgets, a row of the dense variant.
    fastest = next(r for r in rows.values() if r["fastest_dense"])
    assert fastest["variant"] == "dense" and fastest["speedup_b1_vs_fastest_dense"] == 1.0
    against = {"speedup_b1_vs_fastest_dense": row["speedup_b1_vs_fastest_dense"],
               "fastest_dense": f"{fastest['precision']} ({fastest['runtime']})"}  # fmt: skip
    expected = {**pick, "speedup_b1_vs_dense_deployed": row["speedup_b1_vs_dense_deployed"], **beyond, **against}
    assert {key: listed.decoder.get(key) for key in expected} == expected
    # ... and names the form it is compared with, and whether what shipped is dense backed off to.
    assert listed.decoder["form"] == row["precision"].upper() + ("" if row["runtime"] == "genai" else " in llama.cpp")
    assert listed.decoder["backed_off"] is (row["source"] == "dense")
    assert "selected ours" in capsys.readouterr().out
