"""`pruning_pipeline`: the eight DVC stages in order, with an optional set of param overrides."""

from __future__ import annotations

from typing import Any

from prefect import flow
from prefect.artifacts import create_markdown_artifact

from pruneops.benchmark import markdown_table
from tasks.params import apply_overrides
from tasks.stages import STAGES, run_stage


def summary_markdown(metrics: dict[str, dict]) -> str:
    """Baseline vs pruned vs int8: accuracy, params, MACs, latency, size (from `benchmark`)."""
    bench = metrics["benchmark"]
    batch_sizes = sorted(int(b) for b in next(iter(bench["models"].values()))["latency"])
    return (
        "# PruneOps pipeline run\n\n"
        + markdown_table(bench["models"], batch_sizes)
        + f"\nMAC reduction {bench['mac_reduction']:.2f}x; batch-1 speed-up of pruned int8 "
        f"{bench['speedup_b1_pruned_int8_vs_dense']:.2f}x on {bench['machine']['cpu']}.\n"
    )


@flow(name="pruning-pipeline", log_prints=True)
def pruning_pipeline(overrides: dict[str, Any] | None = None, project_dir: str = ".") -> dict[str, dict]:
    """Runs validate -> ... -> benchmark through DVC and publishes a summary artifact.

    Args:
        overrides: Dotted param keys and values written to params.yaml first
            (e.g. `{"prune.target_ratio": 0.7}`); validated before anything runs.
        project_dir: The PruneOps project (where dvc.yaml lives).

    Returns:
        Each stage's metrics. A failing stage fails the flow with that stage's error.
    """
    if overrides:
        apply_overrides(project_dir, overrides)
    metrics: dict[str, dict] = {}
    for stage in STAGES:
        metrics[stage] = run_stage(stage, project_dir)
    create_markdown_artifact(summary_markdown(metrics), key="pruning-summary", description="baseline vs pruned vs int8")
    return metrics
