"""`pruneops bench --only/--variants/--out-dir`: a part of a benchmark measures what the whole does."""

import json

import pytest
import yaml

from pruneops.compare.run import select_runs
from pruneops.compare.workloads import BenchConfig
from pruneops.core.errors import ConfigError
from tests.conftest import ROOT


def _config() -> BenchConfig:
    return BenchConfig.model_validate(
        {
            "workloads": [
                {
                    "name": "a",
                    "variants": [
                        {"name": "dense", "kind": "dense", "family": "dense"},
                        {"name": "tp", "family": "torch_pruning"},
                        {"name": "ours-at-tp", "match_latency_of": "tp"},
                        {"name": "ours-at-that", "match_macs_of": "ours-at-tp"},
                        {"name": "naive"},
                    ],
                },
                {"name": "b", "variants": [{"name": "dense", "kind": "dense"}, {"name": "naive"}]},
            ]
        }
    )


def _names(config: BenchConfig) -> dict[str, list[str]]:
    return {w.name: [v.name for v in w.variants] for w in config.workloads}


def test_a_variant_brings_the_dense_reference_and_what_it_matches_transitively():
    picked = select_runs(_config(), variants=["ours-at-that"], out_dir="docs/part")
    assert _names(picked) == {"a": ["dense", "tp", "ours-at-tp", "ours-at-that"], "b": ["dense"]}
    assert picked.out_dir == "docs/part"
    assert _names(select_runs(_config(), only=["b"], variants=["naive"])) == {"b": ["dense", "naive"]}


def test_nothing_selected_keeps_the_whole_benchmark():
    whole = _config()
    assert select_runs(whole) == whole


@pytest.mark.parametrize(("only", "variants"), [(["c"], None), (None, ["nope"]), (["b"], ["tp"])])
def test_a_name_the_benchmark_does_not_define_is_refused(only, variants):
    with pytest.raises(ConfigError, match="no workload or variant named"):
        select_runs(_config(), only=only, variants=variants)


def test_every_committed_benchmark_variant_can_be_selected_alone():
    for path in sorted((ROOT / "benchmarks").glob("*.yaml")):
        config = BenchConfig.model_validate(yaml.safe_load(path.read_text()))
        for workload in config.workloads:
            for variant in workload.variants:
                picked = select_runs(config, only=[workload.name], variants=[variant.name])
                names = [v.name for v in picked.workloads[0].variants]
                assert variant.name in names and any(v.kind == "dense" for v in picked.workloads[0].variants)


def test_matching_a_latency_keeps_the_form_it_was_timed_in():
    """A ratio measured in static INT8 is a static-INT8 ratio: the matching variant times that form too."""
    from pruneops.compare.run import variant_overrides
    from pruneops.compare.workloads import VariantConfig

    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 4.0}, "latency_form": "static"}}}
    plain = variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), done)
    assert plain["prune.target.value"] == pytest.approx(0.25)
    assert plain["prune.target.form"] == "static"
    asked = VariantConfig(name="ours", match_latency_of="tp", set={"prune.target.form": "fp32"})
    with pytest.raises(ConfigError, match="cannot match the latency of 'tp', timed in static"):
        variant_overrides(asked, done)
    auto = VariantConfig(name="ours", match_latency_of="tp", set={"prune.target.form": "auto"})
    with pytest.raises(ConfigError, match="ours: a latency match is timed in one form; .* not auto"):
        variant_overrides(auto, done)
    fp32 = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}  # a report from before the field
    assert "prune.target.form" not in variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), fp32)


def _export_dir(directory, models: dict, key: str | None = None, quantizer: str | None = None):
    """A variant's results directory as the bench keeps it: the export and val.

    `models` maps manifest keys to modules (or one module under `key`); `quantizer` is the form
    recorded for `pruned_deployed`.
    """
    import numpy as np

    from pruneops.core.io import Layout, dump_json
    from pruneops.data.splits import Split, save_split
    from pruneops.runtimes.onnxruntime.files import export_onnx_file

    models = {key: models} if key is not None else models
    export = Layout(directory).stage_dir("export")
    export.mkdir(parents=True)
    manifest = {}
    for name, model in models.items():
        export_onnx_file(model.eval(), [256], export / f"{name}.onnx", 18)
        manifest[name] = {"file": f"{name}.onnx"}
    if quantizer is not None:
        manifest["pruned_deployed"]["quantizer"] = quantizer
    dump_json({"models": manifest}, export / "manifest.json")
    validate = Layout(directory).stage_dir("validate")
    validate.mkdir(parents=True)
    rng = np.random.default_rng(0)
    save_split(Split(rng.random((8, 256), dtype=np.float32), np.zeros(8, dtype=np.int64)), validate / "val.npz")
    return directory


def _mlp(hidden: int):
    from torch import nn

    return nn.Sequential(nn.Linear(256, hidden), nn.ReLU(), nn.Linear(hidden, hidden), nn.ReLU(), nn.Linear(hidden, 10))


def test_a_latency_match_times_the_other_rows_export_in_every_gate_reading(tmp_path):
    """The matched variant's export in the form matched is the prune stage's reference, at 1.0 of its time."""
    from pruneops.compare.run import reference_to_match, variant_overrides
    from pruneops.compare.workloads import VariantConfig
    from pruneops.config import PruneConfig
    from pruneops.core.params import parse_section
    from pruneops.pipeline.experiments import apply_overrides

    tp = _export_dir(tmp_path / "tp", _mlp(64), "pruned_fp32")
    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}
    lines = []
    ours = VariantConfig(name="ours", match_latency_of="tp")
    reference = reference_to_match(ours, {"tp": tp}, done, lines.append)
    assert reference == (tp / "artifacts/export/pruned_fp32.onnx").resolve() and reference.is_file()
    assert lines == ["ours: matching tp's batch-1 latency, its fp32 export timed in every gate reading"]
    overrides = variant_overrides(ours, done, reference)
    assert overrides["prune.target.kind"] == "latency_ratio" and overrides["prune.target.value"] == 1.0
    assert overrides["prune.target.reference"] == str(reference)
    params = apply_overrides({"prune": {}}, {k: v for k, v in overrides.items() if k.startswith("prune.")})
    parse_section("prune", params["prune"], PruneConfig)  # valid params as the stage will load them
    # A variant matching nothing has no reference.
    assert reference_to_match(VariantConfig(name="plain"), {"tp": tp}, done, lines.append) is None


def test_a_latency_match_in_an_int8_form_is_timed_against_the_deployed_export(tmp_path):
    """A variant timing static INT8 matches the other's deployed static model; not deployed so, the
    other's prune-stage reading, which must then be in that form."""
    from pruneops.compare.run import reference_to_match, timed_file, variant_overrides
    from pruneops.compare.workloads import VariantConfig
    from pruneops.core.errors import ConfigError

    tp = _export_dir(tmp_path / "tp", {"pruned_fp32": _mlp(1024), "pruned_deployed": _mlp(64)}, quantizer="static")
    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}
    ours = VariantConfig(name="ours", match_latency_of="tp", set={"prune.target.form": "static"})
    reference = reference_to_match(ours, {"tp": tp}, done, lambda line: None)
    assert reference == timed_file(tp, "static", dense=False).resolve()
    assert reference.name == "pruned_deployed.onnx"
    overrides = variant_overrides(ours, done, reference)
    assert overrides["prune.target.form"] == "static" and overrides["prune.target.reference"] == str(reference)
    # Deployed in another form than the one asked: no file to time, so the stage's reading, in fp32: refused.
    dynamic = VariantConfig(name="ours", match_latency_of="tp", set={"prune.target.form": "dynamic"})
    lines = []
    assert reference_to_match(dynamic, {"tp": tp}, done, lines.append) is None
    assert lines == ["ours: matching tp's latency as its prune stage measured it (not deployed in dynamic)"]
    with pytest.raises(ConfigError, match="timed in fp32 by its prune stage"):
        variant_overrides(dynamic, done)


def test_a_decoder_row_on_the_results_page_gives_its_speed_up_against_dense_as_deployed(tmp_path):
    from pruneops.compare.results import headline_table

    report = tmp_path / "results" / "llm" / "w"
    report.mkdir(parents=True)
    pick = {"name": "ours deployed", "speedup_b1": 3.9, "test_ratio": 1.04, "test_ratio_ci": [1.0, 1.09]}
    rows = [{"name": "dense fp32", "speedup_b1_vs_dense_deployed": 0.4}, {**pick, "speedup_b1_vs_dense_deployed": 1.6}]
    machine = {"cpu": "AMD EPYC 7B13", "date": "2026-12-05"}
    (report / "results.json").write_text(json.dumps({"decoder_selected": pick, "rows": rows, "machine": machine}))
    (report / "report.md").write_text("# w\n")
    assert "3.90× per generated token (1.60× vs dense INT8)" in headline_table(tmp_path)


def test_the_headline_gives_a_decoder_picks_general_text_and_zero_shot_changes(tmp_path):
    from pruneops.compare.results import headline_table

    report = tmp_path / "results" / "llm" / "w"
    report.mkdir(parents=True)
    pick = {"name": "ours deployed", "speedup_b1": 3.9, "test_ratio": 1.04, "test_ratio_ci": [1.0, 1.09]}
    general = {"value": 3.5, "low": 3.06, "high": 4.01, "unit": "perplexity", "samples": 32}
    zero_shot = {"value": -2.0, "low": -6.0, "high": 1.0, "unit": "points", "samples": 50}
    rows = [{**pick, "general_change": general, "zero_shot_change": zero_shot}]
    machine = {"cpu": "AMD EPYC 7B13", "date": "2026-12-05"}
    (report / "results.json").write_text(json.dumps({"decoder_selected": pick, "rows": rows, "machine": machine}))
    (report / "report.md").write_text("# w\n")
    cell = "perplexity +4.0 % [+0.0, +9.0]; general text +350.0 % [+306.0, +401.0]; zero-shot -2.00 pts [-6.00, +1.00]"
    assert cell in headline_table(tmp_path)


def _decoder_results(tmp_path, data: dict) -> str:
    from pruneops.compare.results import headline_table

    report = tmp_path / "results" / "llm" / "w"
    report.mkdir(parents=True)
    machine = {"cpu": "AMD EPYC 7B13", "date": "2026-12-07"}
    (report / "results.json").write_text(json.dumps({**data, "machine": machine}))
    (report / "report.md").write_text("# w\n")
    return headline_table(tmp_path)


def test_a_decoder_pick_that_shipped_dense_says_so_and_gives_ours_within_the_in_domain_budget_alone(tmp_path):
    # Held to every budget, ours backed off to dense INT8; held to the in-domain budget alone, its cut shipped.
    # Their speed-ups over dense Q4_K_M (the bench's record: decoder_report.versus_form), e.g. 2.0 / 2.5.
    pick = {"name": "ours deployed", "speedup_b1": 2.0, "test_ratio": 1.002, "test_ratio_ci": [1.001, 1.004],
            "speedup_b1_vs_q4_k_m": 0.8}  # fmt: skip
    alone = {"name": "ours-in-domain deployed", "speedup_b1": 3.0, "test_ratio": 1.05, "test_ratio_ci": [1.0, 1.1],
             "speedup_b1_vs_q4_k_m": 1.2}  # fmt: skip
    general = {"value": 3.5, "low": 3.06, "high": 4.01, "unit": "perplexity", "samples": 32}
    rows = [
        {**pick, "family": "ours", "source": "dense", "precision": "int8", "runtime": "genai",
         "speedup_b1_vs_dense_deployed": 1.0},
        {**alone, "family": "ours", "source": "pruned", "precision": "int8", "runtime": "genai",
         "speedup_b1_vs_dense_deployed": 1.5, "general_change": general},
    ]  # fmt: skip
    table = _decoder_results(tmp_path, {"decoder_selected": pick, "decoder_in_domain": alone, "rows": rows})
    assert "`ours deployed` (dense INT8: no cut held every budget)" in table
    assert "2.00× per generated token (1.00× vs dense INT8) (0.80× vs dense Q4_K_M in llama.cpp)" in table
    within = "within the in-domain budget alone `ours-in-domain deployed` 3.00× per generated token (1.50× vs dense"
    assert within + " INT8) (1.20× vs dense Q4_K_M in llama.cpp), test perplexity +5.0 % [+0.0, +10.0]" in table
    assert "general text +350.0 % [+306.0, +401.0]" in table


def test_a_decoder_pick_that_shipped_dense_because_no_cut_was_faster_says_that(tmp_path):
    pick = {"name": "ours deployed", "speedup_b1": 2.0, "test_ratio": 1.002, "test_ratio_ci": [1.001, 1.004]}
    row = {**pick, "family": "ours", "source": "dense", "dense_ships": "not_faster", "precision": "int8",
           "runtime": "genai", "speedup_b1_vs_dense_deployed": 1.0}  # fmt: skip
    table = _decoder_results(tmp_path, {"decoder_selected": pick, "rows": [row]})
    assert "`ours deployed` (dense INT8: no cut within every budget was faster)" in table


def test_a_decoder_pick_that_shipped_its_cut_names_no_back_off_and_no_other_row(tmp_path):
    pick = {"name": "ours deployed", "speedup_b1": 3.9, "test_ratio": 1.04, "test_ratio_ci": [1.0, 1.09]}
    # Ours ships in llama.cpp; dense as deployed (every row's "vs dense as deployed") is dense's own pick.
    dense = {"name": "dense deployed", "family": "dense", "deployed": True, "precision": "q8_0", "runtime": "llamacpp",
             "fastest_dense": True}  # fmt: skip
    rows = [dense, {**pick, "family": "ours", "source": "pruned", "precision": "q4_k_m", "runtime": "llamacpp",
                    "speedup_b1_vs_dense_deployed": 1.6, "speedup_b1_vs_fastest_dense": 1.6}]  # fmt: skip
    table = _decoder_results(tmp_path, {"decoder_selected": pick, "decoder_in_domain": None, "rows": rows})
    assert "`ours deployed` |" in table and "no cut held" not in table and "in-domain" not in table
    # The fastest dense form is dense as deployed: said once.
    assert "3.90× per generated token (1.60× vs dense Q8_0 in llama.cpp) |" in table


def test_a_classifier_row_names_the_form_dense_shipped_in(tmp_path):
    """On Zen 5 the ViT's dense INT8 was no faster than its fp32, so dense shipped fp32: "vs dense INT8" was wrong."""
    from pruneops.compare.results import headline_table

    pick = {"name": "ours deployed", "speedup_b1": 2.0, "speedup_b1_vs_dense_deployed": 2.0, "test_drop_points": 0.1,
            "mac_reduction": 4.0}  # fmt: skip
    report = tmp_path / "results" / "families" / "w"
    report.mkdir(parents=True)
    (report / "report.md").write_text("# w\n")
    for form, cell in (("fp32", "2.00× (2.00× vs dense FP32)"), ("int8", "2.00× (2.00× vs dense INT8)")):
        rows = [{"name": "dense deployed", "family": "dense", "deployed": True, "precision": form}]
        machine = {"cpu": "AMD EPYC", "date": "2026-12-07"}
        (report / "results.json").write_text(json.dumps({"selected": pick, "rows": rows, "machine": machine}))
        assert cell in headline_table(tmp_path)


def test_a_classifier_pick_that_shipped_dense_says_so(tmp_path):
    """MNIST CNN, 2026-12-07: every cut was outside the budget and the pick's row was dense INT8; the results page
    gave `ours-tp-budget deployed` at 1.00x dense INT8 without saying whose model that was."""
    from pruneops.compare.results import headline_table

    pick = {"name": "ours deployed", "family": "ours", "deployed": True, "precision": "int8", "speedup_b1": 2.3,
            "speedup_b1_vs_dense_deployed": 1.0, "test_drop_points": 0.03, "mac_reduction": 1.0}  # fmt: skip
    report = tmp_path / "results" / "mnist" / "w"
    report.mkdir(parents=True)
    (report / "report.md").write_text("# w\n")
    machine = {"cpu": "AMD EPYC", "date": "2026-12-07"}
    for source, cell in (
        ("dense", "`ours deployed` (dense INT8: no cut held every budget) |"),
        ("pruned", "`ours deployed` |"),
    ):
        row = {**pick, "source": source, "dense_ships": "outside_budget" if source == "dense" else None}
        (report / "results.json").write_text(json.dumps({"selected": row, "rows": [], "machine": machine}))
        assert cell in headline_table(tmp_path)
