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
    fp32 = {"tp": {"prune": {"measured_ms": {"1": 1.0}, "dense_ms": {"1": 2.0}}}}  # a report from before the field
    assert "prune.latency_form" not in variant_overrides(VariantConfig(name="ours", match_latency_of="tp"), fp32)
