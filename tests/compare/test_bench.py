"""`pruneops bench` on digits with tiny settings: every recipe measured, selection on validation."""

import json

import numpy as np
import pytest
import yaml

from pruneops.cli import main
from pruneops.compare.report import select_point
from pruneops.compare.run import run_benchmarks
from pruneops.compare.workloads import BenchConfig
from tests.conftest import ROOT, tiny_params

pytestmark = pytest.mark.slow(reason="five variants, each a DVC experiment of six stage processes, timed together")

BENCH = {
    "work_dir": "work",
    "out_dir": "docs",
    "timing": {"repeats": 10, "rounds": 2, "warmup": 2, "batch_sizes": [1, 16]},
    "workloads": [
        {
            "name": "digits-cnn",
            "max_accuracy_drop_points": 50.0,
            "targets": {"speedup_b1": 1.5, "size_reduction": 2.0, "speedup_b1_vs_dense_deployed": 1.2},
            "params": {"prune": {"method": "channel"}},
            "variants": [
                {"name": "dense", "kind": "dense", "family": "dense"},
                {
                    "name": "naive90",
                    "family": "naive",
                    "set": {
                        "prune.method": "magnitude",
                        "prune.scope": "global",
                        "prune.target.value": 0.9,
                        "prune.use_sensitivity": False,
                        "prune.schedule": "oneshot",
                        "prune.steps": 1,
                        "prune.epochs_per_step": 0,
                        "finetune.epochs": 2,
                        "finetune.distill_weight": 0.0,
                    },
                },
                {
                    "name": "tp75",
                    "family": "torch_pruning",
                    "set": {
                        "prune.target.value": 0.75,
                        "prune.use_sensitivity": False,
                        "prune.schedule": "oneshot",
                        "prune.steps": 1,
                        "prune.epochs_per_step": 0,
                        "finetune.epochs": 8,
                        "finetune.distill_weight": 0.0,
                    },
                },
                {
                    "name": "ours-tp-budget",
                    "match_macs_of": "tp75",
                    "set": {
                        "prune.schedule": "oneshot",
                        "prune.steps": 1,
                        "prune.epochs_per_step": 0,
                        # Eight epochs bring a 75 % cut back within the budget on validation (two
                        # left it at 34 %), so this is the pick: each variant costs ~35 s of stage
                        # start-ups here, and a separate ratio-target variant only to be picked
                        # added them to every `make test`.
                        "finetune.epochs": 8,
                    },
                },
                # Out of reach with units capped at half: reported, and the others still measured.
                {"name": "unreachable", "set": {"prune.target.value": 0.95, "prune.max_unit_ratio": 0.5}},
            ],
        }
    ],
}


@pytest.fixture(scope="module")
def bench_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("bench")
    params = tiny_params(sensitivity={"ratios": [0.25, 0.5, 0.75, 0.9]}, prune={"max_unit_ratio": 0.9})
    lines = []
    report = run_benchmarks(BenchConfig(**BENCH), params, "pruneops bench --config t.yaml", root, lines.append)
    return root, params, report, lines


def test_every_recipe_is_measured_together(bench_run):
    root, _, report, lines = bench_run
    rows = {r["name"]: r for r in report.rows["digits-cnn"]}
    assert set(rows) == {
        f"{v} {p}" for v in ("dense", "naive90", "tp75", "ours-tp-budget") for p in ("fp32", "deployed")
    }
    dense = rows["dense fp32"]
    assert dense["speedup_b1"] == pytest.approx(1.0) and dense["mac_reduction"] == pytest.approx(1.0)
    # Unstructured zeros: ~90% of weights gone, the same dense MACs and file, no speed-up to speak of.
    naive = rows["naive90 fp32"]
    assert naive["nonzero_params"] < 0.2 * naive["params"]
    assert naive["macs"] == dense["macs"] and naive["size_reduction"] == pytest.approx(1.0, abs=0.05)
    # Structured: fewer MACs, a smaller file, and the ratio of speed-up to MAC reduction reported.
    tp = rows["tp75 fp32"]
    assert tp["mac_reduction"] > 4 and tp["size_reduction"] > 2
    assert tp["speedup_per_mac_reduction"] == pytest.approx(tp["speedup_b1"] / tp["mac_reduction"])
    # Same MAC budget: ours is allocated to no more MACs than the plain recipe (within a few percent).
    assert rows["ours-tp-budget fp32"]["macs"] <= 1.05 * tp["macs"]
    for r in rows.values():
        assert 0.0 < r["test_accuracy"] <= 1.0 and r["latency"]["1"]["p50_ms"] > 0
    # DVC's run-cache shares the baseline: trained by the first variant, restored for the others.
    assert sum("Running stage 'train'" in line for line in lines) == 1
    # Sensitivity runs once per distinct value of the params it reads (method, whether to sweep):
    # dense and tp75 share (channel, no sweep); naive90 (magnitude, no sweep); unreachable and
    # ours-tp-budget (channel, sweep): a MAC target and a ratio target share the sweep (the
    # target is the latency stage's param, not the sweep's).
    assert sum("Running stage 'sensitivity'" in line for line in lines) == 3
    assert "out of reach" in report.failed["digits-cnn"]["unreachable"]
    assert "unreachable: not measured" in (report.reports["digits-cnn"] / "report.md").read_text()


def test_report_files_and_selection_on_validation(bench_run):
    root, _, report, _ = bench_run
    here = report.reports["digits-cnn"]
    assert here == root / "docs" / "digits-cnn"  # one place per workload: a rerun replaces it
    text = (here / "report.md").read_text()
    assert "pruneops bench --config t.yaml" in text and text.startswith("# digits-cnn:")
    assert "same MAC budget, deployed" in text and "target speedup_b1" in text
    assert (here / "frontier.png").stat().st_size > 10_000
    saved = json.loads((here / "results.json").read_text())
    assert saved["workload"] == "digits-cnn" and saved["command"] == "pruneops bench --config t.yaml"
    assert saved["machine"]["cores"] >= 1
    # The wall time is reported with what DVC did not re-run (the shared baseline, here).
    wall = saved["wall"]
    assert wall["seconds"] > 0 and wall["cached_runs_at_start"] == 0
    assert any("'train'" in line for line in wall["reused_stages"])
    assert "Wall time of this workload" in text and "run-cache was empty at the start, so this is a first" in text
    rows = report.rows["digits-cnn"]
    # The matched row carries its paired interval against the row it was matched to, and the line says it.
    by_name = {r["name"]: r for r in rows}
    for kind in ("fp32", "deployed"):
        mine, theirs = by_name[f"ours-tp-budget {kind}"], by_name[f"tp75 {kind}"]
        low, high = mine["paired_against"][f"tp75 {kind}"]
        delta = 100 * (mine["test_accuracy"] - theirs["test_accuracy"])
        assert low - 1e-9 <= delta <= high + 1e-9 and high - low > 0
    assert text.count("paired on the same images") == 2
    pick = select_point(rows, 50.0)
    assert pick == report.selected["digits-cnn"] and pick["family"] == "ours" and pick["val_drop_points"] <= 50.0
    # The selection ignores the test set: changing test accuracies does not move it.
    shuffled = [{**r, "test_accuracy": 1.0 - r["test_accuracy"]} for r in rows]
    assert select_point(shuffled, 50.0)["name"] == pick["name"]


def test_rerun_reuses_finished_variants_and_cli_writes_the_report(bench_run, capsys):
    root, params, _, _ = bench_run
    (root / "bench.yaml").write_text(yaml.safe_dump(BENCH))
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    assert main(["--root", str(root), "bench", "--config", str(root / "bench.yaml")]) == 0
    out = capsys.readouterr().out
    ran = [line for line in out.splitlines() if "Running stage" in line]
    # Every stage of every finished variant is restored from the run-cache; only the one that
    # failed (out of reach) runs its failing stage again.
    assert ran and all("[digits-cnn] unreachable:" in line for line in ran)
    assert "so this is less than a first run's cost" in (root / "docs" / "digits-cnn" / "report.md").read_text()
    assert "selected" in out and "digits-cnn/report.md" in out


def test_bad_bench_config_is_one_line_exit_2(tmp_path, capsys):
    (tmp_path / "bench.yaml").write_text(yaml.safe_dump({"workloads": [{"name": "x", "variants": [{"nam": 1}]}]}))
    assert main(["--root", str(tmp_path), "bench", "--config", str(tmp_path / "bench.yaml")]) == 2
    assert "bench" in capsys.readouterr().err


def test_pareto_front_keeps_only_unbeaten_points():
    from pruneops.reports.plots import pareto_front

    def row(name, ms, acc):
        return {"name": name, "latency": {"1": {"p50_ms": ms}}, "test_accuracy": acc}

    rows = [row("slow-best", 1.0, 0.99), row("fast-poor", 0.1, 0.90), row("beaten", 0.5, 0.89), row("mid", 0.3, 0.95)]
    assert [r["name"] for r in pareto_front(rows)] == ["fast-poor", "mid", "slow-best"]


def test_budget_search_skips_ratios_out_of_the_sweeps_reach():
    from pruneops.core.errors import ConfigError
    from pruneops.planning.allocation import ratio_for_budget

    def size_at(ratio):
        if ratio > 0.8:  # beyond the allocation cap: the allocation refuses
            raise ConfigError("out of reach")
        return 1000 * (1 - ratio) ** 2

    found = ratio_for_budget(size_at, budget=100, iterations=20)
    assert 0.68 <= found <= 0.69  # 1000 * (1 - t)^2 <= 100  <=>  t >= 0.684
    assert ratio_for_budget(size_at, budget=1000) == 0.0
    with pytest.raises(ConfigError, match="prune.target.value: 10 is out of reach"):
        ratio_for_budget(size_at, budget=10)


def test_targets_are_missed_when_the_validation_pick_fails_on_test(bench_run):
    from pruneops.compare.report import render_markdown
    from pruneops.config import BenchmarkConfig
    from pruneops.timing.machine import machine_info

    _, _, report, _ = bench_run
    config = BenchConfig(**BENCH)
    rows, pick = report.rows, report.selected["digits-cnn"]
    timing = BenchmarkConfig(**BENCH["timing"])

    def verdicts(test_drop: float) -> list[str]:
        changed = {**pick, "test_drop_points": test_drop}
        text = render_markdown(config.workloads[0], rows["digits-cnn"], changed, {}, machine_info(1), timing, "cmd")
        return [line for line in text.splitlines() if line.startswith("- target ")]

    budget = BENCH["workloads"][0]["max_accuracy_drop_points"]
    # Where the speed-ups themselves reach the goal, only the test drop decides.
    inside, outside = verdicts(budget - 0.01), verdicts(budget + 0.01)
    assert len(inside) == len(outside) == 3
    assert all("**missed**" in line for line in outside)
    goals = BENCH["workloads"][0]["targets"]
    assert [("met" in a and "missed" not in a) for a in inside] == [pick[k] >= g for k, g in goals.items()]
    # Against the dense model as deployed: its own b1 latency over the pick's.
    quantised = next(r for r in rows["digits-cnn"] if r["family"] == "dense" and r["deployed"])
    expected = quantised["latency"]["1"]["p50_ms"] / pick["latency"]["1"]["p50_ms"]
    assert pick["speedup_b1_vs_dense_deployed"] == pytest.approx(expected)


@pytest.mark.parametrize("path", sorted((ROOT / "benchmarks").glob("*.yaml")), ids=lambda p: p.name)
def test_every_committed_benchmark_file_and_variant_is_valid_params(path):
    """A typo in a benchmark file fails here, not an hour into its run."""
    from pruneops.compare.run import variant_overrides, workload_params
    from pruneops.core.params import read_params
    from pruneops.pipeline.experiments import apply_overrides

    config = BenchConfig(**yaml.safe_load(path.read_text()))
    base = read_params(ROOT / "params.yaml")
    for workload in config.workloads:
        params = workload_params(base, workload, ROOT)
        # What a matched variant reads from the one it matches (any plausible figures will do).
        done = {
            v.name: {"prune": {"macs": 1e6, "measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}
            for v in workload.variants
        }
        for variant in workload.variants:
            # A latency match as the bench makes it: against the other row's export (whether the
            # other row deployed the matching form is known only once it ran).
            reference = ROOT / "results" / "other" / "pruned_fp32.onnx" if variant.match_latency_of else None
            apply_overrides(params, variant_overrides(variant, done, reference, workload.task))


def test_workload_paths_are_resolved_against_the_project(tmp_path):
    """Data, tokenizer and starting weights named relative to the project work from any workload dir."""
    from pruneops.compare.run import workload_params
    from pruneops.compare.workloads import WorkloadConfig

    workload = WorkloadConfig(
        name="w",
        params={
            "validate": {"dataset": "text", "path": "data/r.csv", "tokenizer": "m/tokenizer.json"},
            "train": {"model": "hf", "pretrained": "m", "init_weights": None},
        },
        variants=[{"name": "dense", "kind": "dense"}],
    )
    params = workload_params({"validate": {}, "train": {}}, workload, tmp_path)
    assert params["validate"]["path"] == str(tmp_path / "data/r.csv")
    assert params["validate"]["tokenizer"] == str(tmp_path / "m/tokenizer.json")
    assert params["train"]["pretrained"] == str(tmp_path / "m") and params["train"]["init_weights"] is None


def test_a_decoder_workloads_general_text_and_zero_shot_check_are_resolved_against_the_project(tmp_path):
    """Every file the stage table says a causal LM's stages read, the zero-shot check among them."""
    from pruneops.compare.run import workload_params
    from pruneops.compare.workloads import WorkloadConfig

    validate = {"dataset": "corpus", "path": "c.txt", "tokenizer": "m", "general_text": "g.txt", "zero_shot": "z.csv"}
    workload = WorkloadConfig(
        name="w",
        params={"validate": validate, "train": {"task": "causal_lm", "model": "hf", "pretrained": "m", "epochs": 0}},
        variants=[{"name": "dense", "kind": "dense"}],
    )
    params = workload_params({}, workload, tmp_path)
    for key, path in validate.items():
        assert params["validate"][key] == (path if key == "dataset" else str(tmp_path / path))
    assert params["train"]["pretrained"] == str(tmp_path / "m")
    assert workload.params["validate"]["zero_shot"] == "z.csv"  # the workload's own params are left as they are


def test_a_variant_deployed_as_fp32_says_why(tmp_path):
    """Two fp32 rows of one variant would read as a duplicate: the deployed one names the reason."""
    from pruneops.compare.report import _why_fp32_deployed

    def note(candidates: dict) -> str:
        path = tmp_path / "metrics.json"
        path.write_text(json.dumps({"quantize": {"fp32_val_accuracy": 0.93, "candidates": candidates}}))
        return _why_fp32_deployed(path)

    fp32 = {"precision": "fp32", "val_accuracy": 0.93, "within_tolerance": True}
    lost = {"precision": "int8", "val_accuracy": 0.8867, "within_tolerance": False}
    kept = {"precision": "int8", "val_accuracy": 0.929, "within_tolerance": True}
    assert note({"fp32": fp32, "static": lost}) == "deployed (static INT8 -4.33 pts on val)"
    assert note({"fp32": fp32, "static": kept}) == "deployed (no INT8 form faster here)"
    assert note({"fp32": fp32}) == "deployed"
    slow = {
        "precision": "int8",
        "val_accuracy": None,
        "within_tolerance": False,
        "not_evaluated": "slower than fp32 at b1 8.10x",
    }
    assert note({"fp32": fp32, "static": lost, "dynamic": slow}) == (
        "deployed (static INT8 -4.33 pts on val, dynamic INT8 slower than fp32 at b1 8.10x)"
    )
    assert note({"fp32": fp32, "dynamic": slow}) == "deployed (no INT8 form faster here)"
    assert _why_fp32_deployed(tmp_path / "absent.json") == "deployed"


def test_a_pruned_variant_that_shipped_dense_says_so_and_why(tmp_path):
    """A classifier variant whose quantize stage shipped dense: its deployed row is dense's, and says so."""
    from pruneops.compare.report import _dense_shipped, _model_rows
    from pruneops.compare.workloads import VariantConfig
    from pruneops.core.io import Layout

    export = Layout(tmp_path).stage_dir("export")
    export.mkdir(parents=True)
    figures = {"params": 10, "nonzero_params": 10, "macs": 100}
    models = {
        "pruned_fp32": {"file": "pruned_fp32.onnx", "precision": "fp32", **figures},
        "pruned_deployed": {"file": "pruned_deployed.onnx", "precision": "int8", "quantizer": "dynamic",
                            "source": "dense", "dense_ships": "not_faster", **figures},
    }  # fmt: skip
    for m in models.values():
        (export / m["file"]).write_bytes(b"onnx")
    (export / "manifest.json").write_text(json.dumps({"models": models}))
    rows = {r["name"]: r for r in _model_rows(VariantConfig(name="ours"), tmp_path)}
    assert rows["ours deployed"]["note"] == "deployed (dense: no form of the pruned model within the budget was faster)"
    # Selected, the row is what the recipe ships, and the selection's line says whose model it is.
    assert _dense_shipped(rows["ours deployed"]) == " (dense: no form of the pruned model within the budget was faster)"
    assert _dense_shipped(rows["ours fp32"]) == ""
    assert rows["ours fp32"]["note"] == ""
    models["pruned_deployed"].update(source="pruned", dense_ships=None)
    (export / "manifest.json").write_text(json.dumps({"models": models}))
    assert [r["note"] for r in _model_rows(VariantConfig(name="ours"), tmp_path)] == ["", ""]


def test_a_row_is_marked_slower_than_dense_only_beyond_timing_noise():
    """The same graph trained from scratch times within noise of dense: not a regression to flag."""
    from pruneops.compare.report import SLOWER_TOLERANCE, _relative_to_dense

    def row(family, b1_ms, b64_ms):
        latency = {
            "1": {"p50_ms": b1_ms, "throughput": 1e3 / b1_ms},
            "64": {"p50_ms": b64_ms, "throughput": 64e3 / b64_ms},
        }
        return {"family": family, "precision": "fp32", "latency": latency, "macs": 10, "size_bytes": 10}

    rows = {
        "dense": row("dense", 1.0, 40.0),
        "twin": row("dense", 1.0 + SLOWER_TOLERANCE / 2, 40.0),
        "slower_b1": row("ours", 1.0 + 2 * SLOWER_TOLERANCE, 20.0),
        "slower_b64": row("ours", 0.5, 40.0 * (1 + 2 * SLOWER_TOLERANCE)),
    }
    for r in rows.values():
        r.update(val_accuracy=0.9, test_accuracy=0.9)
    _relative_to_dense(rows, "64")
    assert {n for n, r in rows.items() if r["slower_than_dense"]} == {"slower_b1", "slower_b64"}


@pytest.mark.parametrize(
    ("accuracy", "ms", "verdict"),
    [
        (0.91, 1.00, "equal or better"),
        (0.91, 1.01, "equal or better"),  # within timing noise
        (0.89, 1.00, "**worse**"),
        (0.91, 0.85, "equal or better, at 15% fewer ms at batch 1"),
        (0.89, 0.85, "**worse**, at 15% fewer ms at batch 1"),
        (0.91, 1.20, "**not comparable**: 20% slower at batch 1, so not the same latency"),
        (0.89, 1.20, "**worse**, and 20% slower at batch 1, so not the same latency"),
    ],
)
def test_a_latency_match_is_judged_on_milliseconds_too(accuracy, ms, verdict):
    from pruneops.compare.report import same_budget_verdict

    def row(acc, b1_ms):
        return {"test_accuracy": acc, "latency": {"1": {"p50_ms": b1_ms}}, "macs": 1000}

    assert same_budget_verdict("measured latency", row(accuracy, ms), row(0.90, 1.0)) == verdict
    # A MAC match at the same MACs is judged on accuracy alone, whatever its milliseconds.
    assert same_budget_verdict("MAC budget", row(accuracy, 5.0), row(0.90, 1.0)) == (
        "equal or better" if accuracy >= 0.90 else "**worse**"
    )


@pytest.mark.parametrize(
    ("accuracy", "macs", "verdict"),
    [
        (0.91, 1000, "equal or better"),
        (0.91, 1040, "equal or better"),  # whole channels: a few percent over the budget
        (0.91, 700, "equal or better"),
        (0.89, 1000, "**worse**"),
        # The gate backed a MAC target off to wider, faster widths (ConvNeXt-style, 2026-11-27: 3.10 M
        # MACs against Torch-Pruning's 2.18 M): measured, but not at the other row's budget.
        (0.91, 1423, "**not comparable**: 42% more MACs, so not the same budget"),
        (0.89, 1423, "**worse**, and 42% more MACs, so not the same budget"),
    ],
)
def test_a_mac_match_is_judged_on_its_macs_too(accuracy, macs, verdict):
    from pruneops.compare.report import same_budget_verdict

    mine = {"test_accuracy": accuracy, "macs": macs, "latency": {"1": {"p50_ms": 9.0}}}
    other = {"test_accuracy": 0.90, "macs": 1000, "latency": {"1": {"p50_ms": 1.0}}}
    assert same_budget_verdict("MAC budget", mine, other) == verdict


@pytest.mark.parametrize("shipped", [("mine",), ("other",), ("mine", "other")])
def test_a_deployed_row_that_shipped_dense_is_compared_with_nothing(shipped):
    """MNIST CNN, 2026-12-07: every recipe's cut was outside the 1-point budget, so both deployed rows of the
    MAC match were dense INT8 and read "equal or better" against each other, a comparison of dense with itself."""
    from pruneops.compare.report import same_budget_verdict

    rows = {
        name: {"label": name, "family": "ours", "deployed": True, "source": "pruned", "test_accuracy": 0.98,
               "macs": 1000, "latency": {"1": {"p50_ms": 1.0}}}
        for name in ("mine", "other")
    }  # fmt: skip
    for name in shipped:
        rows[name] |= {"source": "dense", "dense_ships": "outside_budget", "macs": 4000}
    for what in ("MAC budget", "measured latency"):
        verdict = same_budget_verdict(what, rows["mine"], rows["other"])
        assert verdict == f"**not comparable**: {' and '.join(shipped)} deployed dense's model, not a cut"
    rows["mine"] |= {"source": "pruned", "deployed": False, "macs": 1000}  # an fp32 row is the cut itself
    rows["other"] |= {"source": "pruned", "macs": 1000}
    assert same_budget_verdict("MAC budget", rows["mine"], rows["other"]) == "equal or better"


@pytest.mark.parametrize(
    ("interval", "meaning"),
    [([-0.25, 0.11], "within noise"), ([0.05, 0.4], "better beyond noise"), ([-0.4, -0.05], "worse beyond noise")],
)
def test_a_same_budget_difference_says_whether_the_test_set_resolves_it(interval, meaning):
    from pruneops.compare.report import paired_difference

    other = {"name": "tp fp32", "test_accuracy": 0.9866}
    mine = {"test_accuracy": 0.9859, "paired_against": {"tp fp32": interval}}
    text = paired_difference(mine, other)
    assert text == f"; test -0.07 pts [{interval[0]:+.2f}, {interval[1]:+.2f}] paired on the same images, {meaning}"
    # Reports measured before the interval existed print the line as before.
    assert paired_difference({"test_accuracy": 0.9859}, other) == ""


def test_the_paired_interval_resolves_a_real_difference_and_not_a_coin_flip():
    from pruneops.compare.report import paired_bootstrap_ci

    rng = np.random.default_rng(1)
    reference = rng.random(10_000) < 0.98
    # The same model but 30 of its right answers now wrong: 0.3 pts worse on 10,000 images, disagreeing
    # on 30, which a paired interval resolves (unpaired binomial noise alone is about ±0.4 pts here).
    worse = reference.copy()
    worse[np.flatnonzero(reference)[:30]] = False
    low, high = paired_bootstrap_ci(worse, reference)
    assert high < 0 and low == pytest.approx(-0.3, abs=0.15)
    # Two models disagreeing on 200 images, 100 each way: the same accuracy, and the interval holds 0.
    swapped = reference.copy()
    swapped[np.flatnonzero(reference)[:100]] = False
    swapped[np.flatnonzero(~reference)[:100]] = True
    low, high = paired_bootstrap_ci(swapped, reference)
    assert swapped.mean() == reference.mean() and low < 0 < high


def test_a_workload_whose_variants_all_failed_is_reported_with_why_not_a_traceback(tmp_path):
    from pruneops.compare.report import measure_workload, select_point, write_report
    from pruneops.config import BenchmarkConfig

    config = BenchConfig(**BENCH)
    workload, timing = config.workloads[0], BenchmarkConfig(**BENCH["timing"])
    rows, predictions = measure_workload(tmp_path, workload, {}, timing)
    assert (rows, predictions) == ([], []) and select_point(rows, workload.max_accuracy_drop_points) is None
    why = "experiment dense failed: output 'artifacts/validate' is already tracked by SCM"
    failed = {workload.name: {"dense": why}}
    written = write_report(
        config, {workload.name: rows}, {}, failed, timing, "cmd", tmp_path / "out", {workload.name: []}
    )
    assert why in (written[workload.name] / "report.md").read_text()


def test_a_variant_restored_into_the_workspace_is_not_committed_with_the_params(tmp_path):
    """`dvc exp apply` (to look at a variant) leaves its outputs in the workspace; committing them
    with the next params made every later experiment fail ("already tracked by SCM")."""
    import subprocess

    from pruneops.compare.run import prepare_repo
    from tests.conftest import ROOT, tiny_params

    repo = tmp_path / "workload"
    prepare_repo(repo, tiny_params(), ROOT)
    (repo / "artifacts" / "validate").mkdir(parents=True)
    (repo / "artifacts" / "validate" / "meta.json").write_text("{}")
    (repo / "dvc.lock").write_text("schema: '2.0'\n")
    prepare_repo(repo, tiny_params(train={"epochs": 3}), ROOT)
    tracked = subprocess.run(["git", "ls-files"], cwd=repo, capture_output=True, text=True, check=True).stdout.split()
    assert "params.yaml" in tracked and "dvc.yaml" in tracked
    assert not [f for f in tracked if f.startswith("artifacts/") or f == "dvc.lock"], tracked
    committed = subprocess.run(["git", "show", "HEAD:params.yaml"], cwd=repo, capture_output=True, text=True).stdout
    assert "epochs: 3" in committed


def test_a_latency_match_is_also_compared_with_the_mac_match_of_the_same_row():
    # Issue 15: at the same measured latency ours is no worse than ours with a MAC target, in one
    # run; both are matched to TP, so the report pairs them too (and only rows matched to one row).
    from pruneops.compare.report import _same_budget_lines, compared_pairs
    from pruneops.compare.workloads import WorkloadConfig

    workload = WorkloadConfig.model_validate(
        {
            "name": "w",
            "variants": [
                {"name": "dense", "kind": "dense", "family": "dense"},
                {"name": "tp", "family": "torch_pruning"},
                {"name": "tp-fp32", "family": "torch_pruning"},
                {"name": "ours-ms", "match_latency_of": "tp"},
                {"name": "ours-macs", "match_macs_of": "tp"},
                {"name": "ours-fp32-ms", "match_latency_of": "tp-fp32"},
            ],
        }
    )
    assert compared_pairs(workload) == [
        ("ours-ms", "tp", "measured latency"),
        ("ours-ms", "ours-macs", "measured latency"),
        ("ours-macs", "tp", "MAC budget"),
        ("ours-fp32-ms", "tp-fp32", "measured latency"),
    ]

    def row(name, accuracy, ms):
        return {"variant": name, "deployed": False, "label": name, "name": f"{name} fp32", "test_accuracy": accuracy,
                "val_accuracy": accuracy, "latency": {"1": {"p50_ms": ms}}, "macs": 1000}  # fmt: skip

    items = [row("tp", 0.90, 1.0), row("ours-ms", 0.91, 1.0), row("ours-macs", 0.92, 1.6)]
    lines = _same_budget_lines(workload, items)
    assert len(lines) == 3
    # Ours at TP's ms against ours at TP's MACs: less accurate, but 38% faster, which the verdict says.
    assert (
        lines[1].startswith("- same measured latency, fp32: ours-ms 91.00% test") and "vs ours-macs 92.00%" in lines[1]
    )
    assert lines[1].endswith("**worse**, at 38% fewer ms at batch 1")
