"""Container start-up: params overrides from the environment, and the first published model."""

import shutil

import pytest

import flows.bootstrap as bootstrap_module
from flows.bootstrap import bootstrap, parse_overrides
from pruneops.errors import ConfigError
from pruneops.model_registry import REFERENCE_STATS, ModelRegistry
from tasks.params import apply_overrides, reprune_config
from tests.conftest import ROOT


def test_parse_overrides_reads_values_as_yaml():
    assert parse_overrides("reprune.drift_source=http://prometheus:9090 prune.target_ratio=0.7") == {
        "reprune.drift_source": "http://prometheus:9090",
        "prune.target_ratio": 0.7,
    }
    assert parse_overrides("  ") == {}
    with pytest.raises(ValueError, match="section.key=value"):
        parse_overrides("prune.target_ratio")


def test_overrides_land_in_params_and_a_bad_one_changes_nothing(tmp_path):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    apply_overrides.fn(str(tmp_path), parse_overrides("reprune.drift_source=http://prometheus:9090"))
    assert reprune_config(tmp_path).drift_source == "http://prometheus:9090"
    before = (tmp_path / "params.yaml").read_text()
    with pytest.raises(ConfigError):
        apply_overrides.fn(str(tmp_path), parse_overrides("prune.target_ratio=1.5"))
    assert (tmp_path / "params.yaml").read_text() == before


def test_first_start_runs_the_pipeline_and_publishes_once(pipeline_dir, tmp_path, monkeypatch):
    runs = []

    def fake_pipeline(overrides=None, project_dir="."):
        runs.append(project_dir)
        for name in ("artifacts", "metrics"):
            shutil.copytree(pipeline_dir / name, tmp_path / name, dirs_exist_ok=True)

    monkeypatch.setattr(bootstrap_module, "pruning_pipeline", fake_pipeline)
    shutil.copy(pipeline_dir / "params.yaml", tmp_path / "params.yaml")
    first = bootstrap(str(tmp_path))
    assert first["published"] is True and len(runs) == 1
    production = ModelRegistry(tmp_path / "models").production()
    assert production.version == first["production"]
    assert (production.path / REFERENCE_STATS).exists()
    again = bootstrap(str(tmp_path))
    assert again == {"production": first["production"], "published": False} and len(runs) == 1
