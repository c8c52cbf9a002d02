from prefect.client.schemas.objects import ConcurrencyLimitStrategy

from flows.deploy import build_deployments
from tests.flows.conftest import make_project


def test_deployments_schedule_trigger_and_concurrency(tmp_path):
    project = make_project(tmp_path)
    pipeline, drift, reprune = build_deployments(str(project))
    assert (pipeline.name, drift.name, reprune.name) == ("pipeline", "drift-check", "reprune")
    assert drift.schedules[0].schedule.cron == "*/15 * * * *"
    (trigger,) = reprune.triggers
    assert trigger.expect == {"pruneops.drift.detected"}
    assert trigger.parameters == {"project_dir": str(project), "reason": "drift alert"}
    for deployment in (pipeline, reprune):
        assert deployment.concurrency_limit == 1
        assert deployment.concurrency_options.collision_strategy == ConcurrencyLimitStrategy.CANCEL_NEW
