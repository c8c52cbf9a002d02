"""Container start-up: deployment settings from the environment (in memory), and the first published model."""

import shutil

import pytest

import flows.bootstrap as bootstrap_module
from flows.bootstrap import bootstrap
from pruneops.core.errors import ConfigError
from pruneops.core.params import environment_overrides
from pruneops.modelstore.store import REFERENCE_STATS, ModelRegistry
from pruneops.pipeline.stages import load_section
from tests.conftest import ROOT


def test_environment_overrides_read_values_as_yaml_and_refuse_stage_params():
    assert environment_overrides("reprune.drift_source=http://prometheus:9090 serve.max_batch=64") == {
        "reprune.drift_source": "http://prometheus:9090",
        "serve.max_batch": 64,
    }
    assert environment_overrides("  ") == {}
    with pytest.raises(ConfigError, match="section.key=value"):
        environment_overrides("reprune.drift_source")
    with pytest.raises(ConfigError, match="stage params change through a DVC experiment"):
        environment_overrides("prune.target.value=0.7")


def test_settings_apply_in_memory_and_params_yaml_is_never_written(tmp_path, monkeypatch):
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    before = (tmp_path / "params.yaml").read_text()
    monkeypatch.setenv("PRUNEOPS_SET", "reprune.drift_source=http://prometheus:9090")
    assert load_section(tmp_path, "reprune").drift_source == "http://prometheus:9090"
    monkeypatch.setenv("PRUNEOPS_SET", "reprune.latency_slo_ms=-1")
    with pytest.raises(ConfigError, match="reprune.latency_slo_ms"):
        load_section(tmp_path, "reprune")
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
