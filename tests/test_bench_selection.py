"""`pruneops bench --only/--variants/--out-dir`: a part of a benchmark measures what the whole does."""

import pytest
import yaml

from pruneops.bench import BenchConfig, select_runs
from pruneops.errors import ConfigError
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
    from pruneops.bench import VariantConfig, variant_overrides

    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 4.0}, "latency_form": "static"}}}
    plain = variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), done)
    assert plain["prune.target_value"] == pytest.approx(0.25)
    assert plain["prune.latency_form"] == "static"
    asked = VariantConfig(name="ours", match_latency_of="tp", set={"prune.latency_form": "fp32"})
    with pytest.raises(ConfigError, match="cannot match the latency of 'tp', timed in static"):
        variant_overrides(asked, done)
    auto = VariantConfig(name="ours", match_latency_of="tp", set={"prune.latency_form": "auto"})
    with pytest.raises(ConfigError, match="ours: a latency match is timed in one form; .* not auto"):
        variant_overrides(auto, done)
    fp32 = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}  # a report from before the field
    assert "prune.latency_form" not in variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), fp32)


def _export_dir(directory, models: dict, key: str | None = None, quantizer: str | None = None):
    """A variant's results directory as the bench keeps it: the export and val.

    `models` maps manifest keys to modules (or one module under `key`); `quantizer` is the form
    recorded for `pruned_deployed`.
    """
    import numpy as np

    from pruneops.data.splits import Split, save_split
    from pruneops.io import Layout, dump_json
    from pruneops.onnx_utils import export_onnx_file

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


def test_a_latency_match_aims_at_the_exports_as_the_bench_times_them(tmp_path, monkeypatch):
    """The ratio is the two exported files timed together, and a rerun with the same files reuses it."""
    import pruneops.benchmark
    from pruneops.bench import VariantConfig, matched_latency_ratio, variant_overrides
    from pruneops.config import BenchmarkConfig

    dense = _export_dir(tmp_path / "dense", _mlp(1024), "dense_fp32")
    small = _export_dir(tmp_path / "tp", _mlp(64), "pruned_fp32")
    timing = BenchmarkConfig(threads=1, batch_sizes=[1, 64], warmup=3, repeats=20, rounds=2)
    ratio = matched_latency_ratio(tmp_path, dense, small, timing)
    # 1/16 of the hidden width, ~1/200 of the MACs: faster by far more than timing noise, but not free.
    assert 0.0 < ratio < 0.5
    same_size = _export_dir(tmp_path / "same", _mlp(1024), "pruned_fp32")
    assert matched_latency_ratio(tmp_path, dense, same_size, timing) == pytest.approx(1.0, abs=0.25)

    def no_timing(*args, **kwargs):
        raise AssertionError("timed again although neither file changed")

    monkeypatch.setattr(pruneops.benchmark, "measure_latencies", no_timing)
    assert matched_latency_ratio(tmp_path, dense, small, timing) == ratio
    # Another machine (here, another CPU name) times the pair again.
    import pruneops.latency

    real_fingerprint = pruneops.latency.machine_fingerprint
    monkeypatch.setattr(pruneops.latency, "machine_fingerprint", lambda t: {**real_fingerprint(t), "cpu": "other"})
    with pytest.raises(AssertionError, match="timed again"):
        matched_latency_ratio(tmp_path, dense, small, timing)
    monkeypatch.setattr(pruneops.latency, "machine_fingerprint", real_fingerprint)
    # The measured ratio is the target; the prune stage's reading of the planned widths is not used.
    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}
    overrides = variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), done, ratio)
    assert overrides["prune.target"] == "latency_ratio"
    # aimed at it: the prune stage accepts a reading within one reading's noise over it
    assert overrides["prune.target_value"] == pytest.approx(ratio)


def test_a_latency_match_in_an_int8_form_times_the_deployed_exports(tmp_path):
    """A variant timing static INT8 matches the other's deployed static model against dense's, not fp32."""
    from pruneops.bench import VariantConfig, matched_latency_ratio, timed_file, variant_overrides
    from pruneops.config import BenchmarkConfig
    from pruneops.errors import ConfigError

    # Stand-ins whose widths make the forms tell apart: in fp32 the two are the same size, deployed
    # the dense one is 1/16 the width of the matched one (what a quantizer does is not the point).
    dense = _export_dir(tmp_path / "dense", {"dense_fp32": _mlp(1024), "pruned_deployed": _mlp(64)}, quantizer="static")
    tp = _export_dir(tmp_path / "tp", {"pruned_fp32": _mlp(1024), "pruned_deployed": _mlp(1024)}, quantizer="static")
    timing = BenchmarkConfig(threads=1, batch_sizes=[1, 64], warmup=3, repeats=20, rounds=2)
    assert timed_file(tp, "dynamic", dense=False) is None
    fp32 = matched_latency_ratio(tmp_path, dense, tp, timing)
    static = matched_latency_ratio(tmp_path, dense, tp, timing, "static")
    assert fp32 == pytest.approx(1.0, abs=0.25)
    assert static > 2.0  # the matched deployed model is 16x as wide as dense's deployed one
    with pytest.raises(ConfigError, match="not deployed in dynamic: the dense and the matched variant"):
        matched_latency_ratio(tmp_path, dense, tp, timing, "dynamic")

    # TP's prune stage timed fp32; ours asks static: the bench's static ratio is the target...
    done = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}
    ours = VariantConfig(name="ours", match_latency_of="tp", set={"prune.latency_form": "static"})
    overrides = variant_overrides(ours, done, static)
    assert overrides["prune.latency_form"] == "static"
    assert overrides["prune.target_value"] == pytest.approx(static)
    # ...and without it, the stage's fp32 reading would be the wrong form: refused, not used.
    with pytest.raises(ConfigError, match="timed in fp32 by its prune stage"):
        variant_overrides(ours, done)
