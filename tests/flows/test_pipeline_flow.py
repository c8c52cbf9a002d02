import pytest
import yaml

from flows.pipeline import pruning_pipeline
from pruneops.errors import ConfigError
from tasks.stages import STAGES
from tests.flows.conftest import make_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("flowproject"))


@pytest.mark.e2e
@pytest.mark.slow
def test_pipeline_flow_runs_every_stage_with_overrides(project):
    from prefect.client.orchestration import get_client

    params = project / "params.yaml"
    params.write_text("# a user's comment\n" + params.read_text())
    metrics = pruning_pipeline(overrides={"prune.target_ratio": 0.6}, project_dir=str(project))
    assert list(metrics) == list(STAGES)
    assert metrics["prune"]["target_ratio"] == 0.6
    assert yaml.safe_load((project / "params.yaml").read_text())["prune"]["target_ratio"] == 0.6
    assert params.read_text().startswith("# a user's comment\n")  # overrides keep comments
    assert metrics["benchmark"]["mac_reduction"] > 1.5

    async def artifact_keys():
        async with get_client() as client:
            return [a.key for a in await client.read_artifacts()]

    import asyncio

    assert "pruning-summary" in asyncio.run(artifact_keys())


@pytest.mark.e2e
@pytest.mark.slow
def test_failing_stage_fails_the_flow_with_its_error(project):
    text = (project / "params.yaml").read_text().replace("target_ratio: 0.6", "target_ratio: 1.5")
    (project / "params.yaml").write_text(text)
    state = pruning_pipeline(project_dir=str(project), return_state=True)
    assert state.is_failed()
    with pytest.raises(
        Exception,
        match=r"stage sensitivity failed \(exit 2\): pruneops sensitivity: error: "
        r"prune.target_ratio: must be less than 1 \(got 1.5\)",
    ):
        state.result()


def test_bad_override_is_refused_before_anything_runs(tmp_path):
    project = make_project(tmp_path)
    before = (project / "params.yaml").read_text()
    with pytest.raises(ConfigError, match="prune.target_ratio: must be less than 1"):
        pruning_pipeline(overrides={"prune.target_ratio": 3}, project_dir=str(project))
    assert (project / "params.yaml").read_text() == before
    assert not (project / "artifacts").exists()
