from pathlib import Path

import pytest
import yaml

from pruneops.config import ConfigError, PruneConfig, QuantizeConfig, TrainConfig
from pruneops.core.params import parse_section, read_params
from pruneops.pipeline.stages import SECTIONS, STAGES, check_sections, load_configs
from tests.conftest import ROOT

RATIO = {"target": {"kind": "ratio", "value": 0.5}}


def latency(**target) -> dict:
    """A `prune` section whose latency target has these keys over the default's."""
    return {"target": {"kind": "latency_ratio", "value": 0.5, **target}}


def test_project_params_are_valid_for_every_section():
    configs = load_configs(read_params(ROOT / "params.yaml"))
    assert set(configs) == set(SECTIONS)


def test_params_yaml_lists_every_key_of_each_stage():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    # The embedded params are a classifier's: every key that applies to one (a causal LM's keys are
    # refused there; examples/causal-lm/params.yaml writes those).
    for stage in STAGES:
        assert set(params[stage.name]) == set(stage.config.keys_for("classification")), stage.name
    prune = params["prune"]
    for block in ("target", "gate", "trials", "distillation"):
        nested = PruneConfig.model_fields[block].annotation
        nested = next(a for a in getattr(nested, "__args__", (nested,)) if a is not type(None))
        assert set(prune[block]) == set(nested.keys_for("classification")), block


@pytest.mark.parametrize(
    ("raw", "line"),
    [
        (
            {"target_value": 0.4},
            "prune.target_value: moved to prune.target.value (the section nests target, gate, trials, distillation)",
        ),
        ({"min_speedup": 1.1}, "prune.min_speedup: moved to prune.gate.min_speedup"),
        ({"plan_trials": 2}, "prune.plan_trials: moved to prune.trials.count"),
        ({"hidden_distill_weight": 1.0}, "prune.hidden_distill_weight: moved to prune.distillation.hidden_weight"),
        ({"target": "macs"}, "prune.target: a block now, e.g. target: {kind: macs, value: 0.5}"),
    ],
)
def test_a_key_of_the_flat_prune_section_says_where_it_moved_in_one_line(raw, line):
    with pytest.raises(ConfigError) as exc:
        parse_section("prune", raw, PruneConfig)
    assert str(exc.value).startswith(line) and "\n" not in str(exc.value) and exc.value.exit_code == 2


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (latency(value=1.0), "prune.target.value: a ratio must be less than 1 (got 1.0)"),
        ({"target": {"kind": "ratio", "value": 1.0}}, "prune.target.value: a ratio must be less than 1 (got 1.0)"),
        (latency(value=-0.1), "prune.target.value: must be greater than or equal to 0"),
        (latency(value="half"), "prune.target.value: must be a valid number"),
        ({"steps": 0}, "prune.steps: must be greater than or equal to 1"),
        ({"trget": 0.5}, "prune.trget: unknown key; allowed keys: method, target, gate, trials, distillation"),
        (latency(vaule=0.5), "prune.target.vaule: unknown key; allowed keys: kind, value, batch, reference, form"),
        ({"schedule": "exp"}, "prune.schedule: unknown pruning schedule 'exp'; choose from: cubic, linear, oneshot"),
        ({"method": "chanel"}, "prune.method: unknown pruning method 'chanel'; choose from: channel, fisher, head"),
        ({"importance": "l3"}, "prune.importance: unknown importance criterion 'l3'"),
        (latency(value=None), "prune.target.value: must be a valid number"),
        ({"target": {"kind": "latency_ratio"}}, "prune.target.value: Field required"),
        (
            {"target": {"kind": "macs", "value": 1e6}, "method": "magnitude"},
            "prune.target.kind: macs targets need a structured",
        ),
    ],
)
def test_bad_values_give_one_line_naming_key_and_allowed(raw, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_section("prune", raw, PruneConfig)
    message = str(exc.value)
    assert fragment in message
    assert "\n" not in message
    assert exc.value.exit_code == 2


SCOPE = "prune.scope: does not apply to method 'channel' (it applies to: magnitude, movement)"
ROUND = "prune.round_to: does not apply to method 'magnitude' (it applies to: channel, fisher, head)"
NO_TARGET = {"target": None}


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"method": "channel", "scope": "layer"}, SCOPE),
        ({**RATIO, "method": "magnitude", "round_to": 8}, ROUND),
        ({**RATIO, "method": "semi_structured", "importance": None}, "prune.target: does not apply to method"),
        ({**NO_TARGET, "method": "semi_structured"}, "prune.importance: does not apply"),
        (
            {"target": {"kind": "ratio", "value": 0.8}, "method": "movement"},
            "prune.importance: does not apply to method 'movement'",
        ),
        (
            {**RATIO, "method": "magnitude", "importance": "taylor"},
            "prune.importance: method 'magnitude' ranks weights",
        ),
        ({"method": "channel", "importance": None}, "prune.importance: required by method 'channel'"),
        (
            {"method": "magnitude", "importance": "l2"},
            "prune.target.kind: latency_ratio targets need a structured method",
        ),
        (latency(kind="latency_ms", batch=None), "prune.target.batch: required by kind 'latency_ms'"),
        ({"target": {"kind": "ratio", "value": 0.5, "batch": 1}}, "prune.target.batch: applies to latency kinds only"),
        (latency(value=0.0), "prune.target.value: a latency ratio must be more than 0"),
        ({**RATIO, "trials": {"count": 4}}, "prune.trials.count: ranks latency plans only (target kind is 'ratio')"),
        ({"trials": {"count": 0}}, "prune.trials.count: must be greater than or equal to 1"),
    ],
)
def test_keys_that_do_not_apply_to_the_method_are_refused_at_load(raw, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_section("prune", raw, PruneConfig)
    assert fragment in str(exc.value) and exc.value.exit_code == 2


REFERENCE = latency(reference="served/model.onnx")


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        (
            {"target": {"kind": "ratio", "value": 0.5, "reference": "served/model.onnx"}},
            "prune.target.reference: applies to kind latency_ratio only (kind is 'ratio')",
        ),
        (latency(reference="served/model.pt"), "prune.target.reference: an ONNX model file (.onnx)"),
        (
            latency(reference="served/model.onnx", value=4.5),
            "prune.target.value: a ratio of the reference's latency must be in (0, 4]",
        ),
        (
            latency(reference="served/model.onnx", value=0.0),
            "prune.target.value: a ratio of the reference's latency must be in (0, 4]",
        ),
    ],
)
def test_a_latency_target_relative_to_a_reference_model_is_checked_at_load(raw, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_section("prune", raw, PruneConfig)
    assert fragment in str(exc.value) and exc.value.exit_code == 2


def test_a_reference_model_may_be_matched_or_beaten_by_any_ratio_up_to_the_bound():
    """1.0 (as fast as the reference) and more are ratios of the reference, not of dense."""
    for value in (0.5, 1.0, 2.0):
        parse_section("prune", latency(reference="served/model.onnx", value=value), PruneConfig)
    with pytest.raises(ConfigError, match="a ratio must be less than 1"):
        parse_section("prune", latency(value=1.0), PruneConfig)


def test_the_reference_is_read_as_a_path_only_when_set():
    assert parse_section("prune", REFERENCE, PruneConfig).target.reference_file == Path("served/model.onnx")
    assert parse_section("prune", {}, PruneConfig).target.reference_file is None


def test_plan_trials_default_to_four_for_latency_targets_and_none_otherwise():
    assert parse_section("prune", {}, PruneConfig).trial_count == 4
    assert parse_section("prune", {"trials": {"count": 1}}, PruneConfig).trial_count == 1
    assert parse_section("prune", RATIO, PruneConfig).trial_count == 1


def test_every_method_accepts_exactly_its_own_keys():
    for raw in (
        {"method": "semi_structured", "target": None, "importance": None},
        {**RATIO, "method": "movement", "importance": None, "scope": "layer"},
        {**RATIO, "method": "magnitude", "importance": "l1", "scope": "global"},
        {"method": "head", "round_to": 8, "importance": "taylor"},
        {"method": "channel", "target": {"kind": "macs", "value": 1e6}},
        {"method": "channel", **latency(kind="latency_ms", value=0.05, batch=64)},
    ):
        parse_section("prune", raw, PruneConfig)


def test_unknown_registry_names_are_refused_at_load_in_every_section():
    with pytest.raises(ConfigError, match="train.model: unknown model 'resnet'"):
        parse_section("train", {"model": "resnet"}, TrainConfig)
    with pytest.raises(ConfigError, match=r"train.model: cannot import factory 'nopkg.models:build'"):
        parse_section("train", {"model": "nopkg.models:build"}, TrainConfig)
    with pytest.raises(ConfigError, match="quantize.method: unknown quantizer 'fast'"):
        parse_section("quantize", {"method": "fast"}, QuantizeConfig)
    params = read_params(ROOT / "params.yaml")
    params["validate"]["dataset"] = "imagenet"
    with pytest.raises(ConfigError, match="validate.dataset: unknown dataset 'imagenet'"):
        load_configs(params)


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match="prunee: unknown section"):
        check_sections({"prunee": {}})


def test_a_stage_section_missing_from_the_file_is_refused(tmp_path):
    params = read_params(ROOT / "params.yaml")
    del params["train"]
    with pytest.raises(ConfigError, match="train: section missing from the params file"):
        load_configs(params, ("train",))


def test_a_missing_short_section_names_its_defaults_as_yaml_to_paste():
    import yaml

    from pruneops.config import LatencyConfig

    params = read_params(ROOT / "params.yaml")
    del params["latency"]
    with pytest.raises(ConfigError, match="latency: section missing") as raised:
        load_configs(params, ("latency",))
    (line,) = str(raised.value).splitlines()
    pasted = yaml.safe_load(line.split("its defaults are `")[1].rstrip("`"))
    assert LatencyConfig(**pasted["latency"]) == LatencyConfig()
    params["latency"] = pasted["latency"]
    assert load_configs(params, ("latency",))["latency"] == LatencyConfig()


def test_read_params_rejects_non_mapping(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_params(path)


def test_an_unknown_key_inside_a_nested_section_lists_that_sections_keys():
    from pruneops.config import TrainConfig

    with pytest.raises(ConfigError) as exc:
        parse_section("train", {"preprocess": {"rotate": 90}}, TrainConfig)
    assert str(exc.value) == "train.preprocess.rotate: unknown key; allowed keys: resize, channels, mean, std"


def test_a_teacher_on_onnx_runtime_cannot_give_block_outputs():
    from pruneops.config import FinetuneConfig

    with pytest.raises(ConfigError, match="hidden_distill_weight > 0 needs the teacher's block outputs"):
        parse_section("finetune", {"teacher_runtime": "onnxruntime", "hidden_distill_weight": 1.0}, FinetuneConfig)
    config = parse_section("finetune", {"teacher_runtime": "onnxruntime"}, FinetuneConfig)
    assert config.teacher_runtime == "onnxruntime"


def test_a_latency_target_batch_must_be_one_the_latency_table_measures():
    params = read_params(ROOT / "params.yaml")
    params["prune"]["target"] = {"kind": "latency_ratio", "value": 0.5, "batch": 32}
    params["benchmark"]["batch_sizes"] = [1, 64]
    with pytest.raises(ConfigError, match=r"prune.target.batch: 32 is not a batch .* add it to benchmark.batch_sizes"):
        load_configs(params)
    params["benchmark"]["batch_sizes"] = [1, 32]
    assert load_configs(params)["prune"].target.batch == 32


def test_an_empty_section_is_refused_rather_than_run_on_defaults():
    params = read_params(ROOT / "params.yaml")
    params["train"] = None
    with pytest.raises(ConfigError, match="^train: the section is empty"):
        load_configs(params)


def test_a_huge_value_is_not_echoed_back_whole():
    with pytest.raises(ConfigError) as raised:
        parse_section("train", {"epochs": list(range(10_000))}, TrainConfig)
    assert len(str(raised.value)) < 300 and "characters)" in str(raised.value)


def test_a_causal_lms_recovery_takes_its_own_defaults_where_the_file_sets_none():
    """A decoder's `finetune: {max_tokens: N}` alone once stepped 64 blocks at a time (a classifier's
    batch): 64 blocks' logits over a 49k vocabulary are 3 GiB each, and the recovery study ran out of
    24 GiB in its first step. A causal LM's unset keys take its own defaults; set ones are kept."""
    train = {"task": "causal_lm", "model": "hf", "pretrained": "model", "epochs": 0}
    decoder = load_configs({"train": train, "finetune": {"max_tokens": 1024, "lr": 0.001}}, ("train", "finetune"))
    finetune = decoder["finetune"]
    assert (finetune.batch_size, finetune.lr, finetune.distill_temperature) == (4, 0.001, 1.0)
    classifier = load_configs({"train": {"epochs": 1}, "finetune": {}}, ("train", "finetune"))["finetune"]
    assert (classifier.batch_size, classifier.lr, classifier.distill_temperature) == (64, 0.001, 4.0)
