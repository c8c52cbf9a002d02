"""`pruneops bench-decoder` end to end on a tiny Llama and a made-up corpus (every row measured)."""

from __future__ import annotations

import json

import pandas as pd
import pytest
import yaml

pytest.importorskip("transformers")
pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")

from pruneops.cli import main  # noqa: E402
from pruneops.planning.decode_cost import LOOP_ROUNDS, DecoderShape  # noqa: E402
from tests.conftest import ROOT  # noqa: E402
from tests.llm.decoder_helpers import save_tiny, speeches  # noqa: E402


def pruneops_shape(fields: dict) -> str:
    """A row's recorded shape as the loop names it."""
    return DecoderShape(**fields).describe()


def _timing_by_file_size(models, prompt, new_tokens=64, rounds=5, warmup=1):
    """Injected timings: proportional to the exported weights (what decode at batch 1 reads)."""
    from pruneops.runtimes.genai.generation import GenerationTiming

    out = {}
    for name, folder in models.items():
        mb = sum(p.stat().st_size for p in folder.glob("model.onnx*")) / 2**20
        tpot = 0.05 + mb * prompt.shape[0] ** 0.5
        out[name] = GenerationTiming(4 * tpot, tpot, (tpot,) * rounds, prompt.shape[1], new_tokens, prompt.shape[0])
    return out


@pytest.mark.slow(reason="a dozen onnxruntime-genai exports: timed shapes, the loop's plans, dense, ours, baselines")
def test_bench_decoder_writes_a_report_with_every_row_measured(tmp_path, monkeypatch):
    import pruneops.compare.decoder as bench
    import pruneops.task.causal_lm.common as common

    monkeypatch.setattr(bench, "time_generation", _timing_by_file_size)
    monkeypatch.setattr(common, "time_generation", _timing_by_file_size)
    hf = save_tiny("llama", tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n\n".join(speeches(60)))
    (tmp_path / "ood.txt").write_text("\n\n".join(speeches(10, seed=9)))
    pd.DataFrame({"text": ["a great film", "an awful film"] * 10, "label": ["fresh", "rotten"] * 10}).to_csv(
        tmp_path / "reviews.csv", index=False
    )
    bench = {
        "workload": "tiny", "bench": "llm-test", "model": str(hf), "corpus": str(tmp_path / "corpus.txt"),
        "out_of_domain": str(tmp_path / "ood.txt"),
        "zero_shot": {"path": str(tmp_path / "reviews.csv"), "prompt": "{text} . it was",
                      "answers": {"fresh": "good", "rotten": "bad"}, "samples": 10},
        "block_length": 16, "calibration_blocks": 4, "search_blocks": 2, "val_blocks": 4, "test_blocks": 6,
        "ood_blocks": 4, "targets": [0.85], "max_layers_dropped": 2, "precisions": ["int8"],
        "prompt_length": 8, "new_tokens": 6, "batches": [1, 2], "rounds": 1, "recovery_tokens": 48,
        "vocabulary": [20], "vocabulary_tail_groups": 4,
    }  # fmt: skip
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump(bench))
    out = tmp_path / "results"
    assert main(["bench-decoder", "--config", str(tmp_path / "bench.yaml"), "--out-dir", str(out)]) == 0
    where = out / "llm-test" / "tiny"
    results = json.loads((where / "results.json").read_text())
    kinds = {r["kind"] for r in results["rows"]}
    assert {"dense", "ours"} <= kinds
    for row in results["rows"]:
        assert row["test_ppl_ci"][0] <= row["test_ppl"] <= row["test_ppl_ci"][1]
        assert row["tpot_b1_ms"] > 0 and row["tpot_b2_ms"] > 0 and row["ood_ppl"] > 1
    dense = results["rows"][0]
    assert dense["name"] == "dense fp32" and dense["test_ratio"] == pytest.approx(1.0)
    ours = next(r for r in results["rows"] if r["kind"] == "ours" and r["precision"] == "fp32")
    assert ours["predicted_tpot_b1_ms"] <= 0.85 * results["latency_table"][0]["tpot_ms"] + 1e-9
    assert ours["zero_shot"] is not None and 0 <= ours["zero_shot"][0] <= 1
    assert results["deployed"]["0.85"].startswith("ours 0.85")
    assert results["recovery"]["0.85"]["tokens"] == 48 and "ours, cut only" in kinds
    # The recovered plan with its vocabulary cut: rows in fp32 and INT8, scored over the whole vocabulary.
    cut = [r for r in results["rows"] if r["vocabulary"] == 20]
    assert [r["name"] for r in cut] == ["ours 0.85 vocab20 fp32", "ours 0.85 vocab20 int8"]
    assert all(r["shape"] == ours["shape"] and "vocabulary 20" in r["shape_text"] for r in cut)
    assert all(1 < r["test_ppl"] < float("inf") and 1 < r["ood_ppl"] < float("inf") for r in cut)
    report = (where / "report.md").read_text()
    assert "ours 0.85 fp32" in report and "48 tokens" in report and (where / "frontier.png").stat().st_size
    assert 0 < results["plan_search_s"]["0.85"] < results["wall_s"] and "Pruning (every feasible plan" in report
    # The closed loop: the kept plan is its last round's, at the target as timed (file-size timings) or after
    # every round it may take; each later round planned for a tighter target than the one before.
    loop = results["loop"]["0.85"]
    kept = pruneops_shape(ours["shape"])
    assert loop[-1]["shape"] == kept and "Closed loop" in report
    assert loop[-1]["measured_ratio"] <= 0.85 or len(loop) == LOOP_ROUNDS
    assert all(after["target_ms"] < before["predicted_ms"] for before, after in zip(loop, loop[1:], strict=False))


def test_a_bad_bench_file_is_one_line(tmp_path, capsys):
    (tmp_path / "bench.yaml").write_text("workload: x\nmodel: m\ncorpus: c\ntargets: [1.5]\n")
    assert main(["bench-decoder", "--config", str(tmp_path / "bench.yaml")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "targets.0" in err[0]


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks" / "decoders").glob("*.yaml")), ids=lambda p: p.name)
def test_committed_decoder_bench_files_are_valid(path):
    from pruneops.compare.decoder import load_bench_config

    config = load_bench_config(path)
    assert config.targets and all(0 < t < 1 for t in config.targets)
