import pytest
import yaml

from pruneops.config import (
    STAGE_CONFIGS,
    ConfigError,
    PruneConfig,
    check_sections,
    load_stage_config,
    parse_section,
    read_params,
)
from tests.conftest import ROOT


def test_project_params_are_valid_for_every_stage():
    params = read_params(ROOT / "params.yaml")
    check_sections(params)
    for stage in STAGE_CONFIGS:
        load_stage_config(params, stage)


def test_params_yaml_and_dvc_yaml_list_every_key_of_each_stage():
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    dvc = yaml.safe_load((ROOT / "dvc.yaml").read_text())
    for stage, cls in STAGE_CONFIGS.items():
        assert set(params[stage]) == set(cls.model_fields), stage
        listed = {p for p in dvc["stages"][stage]["params"]}
        assert {f"{stage}.{k}" for k in cls.model_fields} <= listed, stage
        assert any(d.startswith(f"pruneops/{stage}") for d in dvc["stages"][stage]["deps"]), stage


@pytest.mark.parametrize(
    ("raw", "fragment"),
    [
        ({"target_ratio": 1.0}, "prune.target_ratio: must be less than 1 (got 1.0)"),
        ({"target_ratio": -0.1}, "prune.target_ratio: must be greater than or equal to 0"),
        ({"target_ratio": "half"}, "prune.target_ratio: must be a valid number"),
        ({"steps": 0}, "prune.steps: must be greater than or equal to 1"),
        ({"trget_ratio": 0.5}, "prune.trget_ratio: unknown key; allowed keys: method, target_ratio"),
        ({"schedule": "exp"}, "prune.schedule: must be 'cubic', 'linear' or 'oneshot'"),
    ],
)
def test_bad_values_give_one_line_naming_key_and_allowed(raw, fragment):
    with pytest.raises(ConfigError) as exc:
        parse_section("prune", raw, PruneConfig)
    message = str(exc.value)
    assert fragment in message
    assert "\n" not in message
    assert exc.value.exit_code == 2


def test_unknown_section_is_rejected():
    with pytest.raises(ConfigError, match="prunee: unknown section"):
        check_sections({"prunee": {}})


def test_read_params_rejects_non_mapping(tmp_path):
    path = tmp_path / "params.yaml"
    path.write_text("- just\n- a list\n")
    with pytest.raises(ConfigError, match="must be a mapping"):
        read_params(path)
