import subprocess
from pathlib import Path

import pytest

from flows.pipeline import pruning_pipeline
from pruneops.core.errors import ConfigError
from tasks.stages import STAGES
from tests.flows.conftest import make_project


@pytest.fixture(scope="module")
def project(tmp_path_factory):
    return make_project(tmp_path_factory.mktemp("flowproject"))


@pytest.mark.e2e
@pytest.mark.slow(reason="the Prefect flow runs every stage as a DVC experiment")
def test_pipeline_flow_runs_overrides_as_a_dvc_experiment_and_leaves_params_alone(project):
    from prefect.client.orchestration import get_client

    params = project / "params.yaml"
    before = params.read_text()
    metrics = pruning_pipeline(overrides={"prune.target.value": 0.6}, project_dir=str(project))
    assert list(metrics) == [*STAGES, "experiment"]
    assert metrics["prune"]["target_value"] == 0.6
    assert params.read_text() == before  # nothing rewrote the workspace's params.yaml
    assert not (project / "artifacts").exists()  # nor its outputs
    assert metrics["benchmark"]["mac_reduction"] > 1.5
    assert not (project / "state/experiments" / metrics["experiment"]).exists()  # worktree removed

    async def artifact_keys():
        async with get_client() as client:
            return [a.key for a in await client.read_artifacts()]

    import asyncio

    assert "pruning-summary" in asyncio.run(artifact_keys())


@pytest.mark.e2e
@pytest.mark.slow
def test_failing_stage_fails_the_flow_with_its_error(project):
    text = (project / "params.yaml").read_text().replace("value: 0.5", "value: 1.5")
    (project / "params.yaml").write_text(text)
    state = pruning_pipeline(project_dir=str(project), return_state=True)
    assert state.is_failed()
    # The stages before prune are restored from DVC's run-cache (the experiment above ran them);
    # the first one that runs loads, validates and refuses the params.
    with pytest.raises(
        Exception,
        match=r"stage (\w+) failed \(exit 2\): pruneops \1: error: "
        r"prune.target.value: a ratio must be less than 1 \(got 1.5\)",
    ):
        state.result()


def test_bad_override_is_refused_before_anything_runs(tmp_path):
    project = make_project(tmp_path)
    before = (project / "params.yaml").read_text()
    with pytest.raises(ConfigError, match="prune.target.value: a ratio must be less than 1"):
        pruning_pipeline(overrides={"prune.target.value": 3}, project_dir=str(project))
    assert (project / "params.yaml").read_text() == before
    assert not (project / "artifacts").exists() and not (project / "state/experiments").exists()


def _decoder_project(root: Path) -> Path:
    """A committed git + DVC project of a tiny random Llama on made-up speeches (seconds per stage)."""
    from pruneops.pipeline.dvcfile import write_dvc_yaml
    from pruneops.pipeline.experiments import tool_env
    from tests.conftest import write_params
    from tests.decoder_helpers import decoder_params, save_tiny, speeches

    root.mkdir(parents=True, exist_ok=True)
    save_tiny("llama", root / "model")
    (root / "corpus.txt").write_text("\n\n".join(speeches(60)))
    write_params(root, decoder_params(Path("model"), Path("corpus.txt")))
    write_dvc_yaml(root)
    (root / ".gitignore").write_text("/state/\n/models/\n")
    for cmd in (["git", "init", "-q"], ["dvc", "init", "-q"], ["git", "add", "-A"], ["git", "commit", "-qm", "p"]):
        subprocess.run(cmd, cwd=root, env=tool_env(), check=True, capture_output=True)
    return root


@pytest.mark.e2e
@pytest.mark.slow(reason="every stage of a tiny decoder through DVC under the flow: about two minutes")
def test_the_pipeline_flow_runs_a_decoder_project_and_publishes_its_summary(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from prefect.client.orchestration import get_client

    project = _decoder_project(tmp_path / "decoder")
    metrics = pruning_pipeline(project_dir=str(project))
    assert list(metrics) == list(STAGES)
    bench = metrics["benchmark"]
    assert bench["task"] == "causal_lm" and bench["latency_metric"] == "time per output token"
    assert set(bench["models"]) >= {"dense_fp32", "pruned_fp32", "pruned_deployed"}

    async def summaries():
        async with get_client() as client:
            return [a.data for a in await client.read_artifacts() if a.key == "pruning-summary"]

    import asyncio

    published = asyncio.run(summaries())
    assert any("time per output token" in text and "test perplexity" in text for text in published), published
