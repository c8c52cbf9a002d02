"""`reprune`: version new data, re-run the pipeline on it as a DVC experiment, promote only if as good.

The workspace is not touched beyond versioning the new data (`dvc add`): its params.yaml and data
source stay as they are; the experiment runs in its own worktree (`pruneops.pipeline.experiments`).
"""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from pruneops.config import CORPUS_DATASET
from pruneops.core.io import dump_json
from pruneops.core.params import read_params
from pruneops.modelstore.gate import decide_candidate
from pruneops.modelstore.store import ModelRegistry, git_revision
from pruneops.pipeline.experiments import Experiment, LockHeld, project_lock, run_logged
from pruneops.pipeline.stages import load_section
from tasks.stages import run_experiment_task


@task(task_run_name="version-data")
def version_data(project_dir: str, data_path: str) -> dict[str, str]:
    """Brings new labelled data under DVC (`dvc add`) and returns its path and content hash."""
    project = Path(project_dir).resolve()
    source = Path(data_path).resolve()
    if not source.is_file():
        raise FileNotFoundError(f"{source}: new data not found")
    if project not in source.parents:
        target = project / "data" / "incoming" / source.name
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, target)
        source = target
    code, tail = run_logged(["dvc", "add", str(source.relative_to(project))], project, get_run_logger().info)
    if code != 0:
        raise RuntimeError(f"dvc add {source} failed: {tail[-1] if tail else ''}")
    meta = Path(f"{source}.dvc").read_text()
    md5 = next((line.split(":", 1)[1].strip() for line in meta.splitlines() if "md5:" in line), "")
    return {"path": str(source.relative_to(project)), "md5": md5}


def dataset_overrides(project: Path, path: str) -> dict[str, Any]:
    """Params that point the experiment's `validate` at a data file (NPZ, or CSV/Parquet tables).

    A text project stays text: the serving app keeps labelled texts as `text`/`label` columns.
    """
    # Absolute: the experiment's worktree has the data's .dvc file only once it is committed.
    located = str((project / path).resolve())
    dataset = load_section(project, "validate").dataset
    if dataset == CORPUS_DATASET:  # the served prompts and references
        return {"validate.path": located, "validate.text_column": "text"}
    if dataset == "text":
        return {
            "validate.path": located,
            "validate.text_column": "text",
            "validate.label_column": "label",
            "validate.exclude_labels": None,
        }
    kind = "npz" if path.endswith(".npz") else "table"
    return {"validate.dataset": kind, "validate.path": located}


def default_feedback(project: Path, feedback_dir: str) -> Path:
    """The serving app's labelled data: texts as CSV for a text project, arrays as NPZ otherwise.

    A decoder's (`pruneops serve-decoder --feedback-file`) is JSONL: a prompt and its reference continuation per line.
    """
    dataset = load_section(project, "validate").dataset
    name = {"text": "feedback.csv", CORPUS_DATASET: "feedback.jsonl"}.get(dataset, "feedback.npz")
    return project / feedback_dir / name


def gate(project: Path, experiment: Experiment, data: dict, reason: str) -> dict[str, Any]:
    """Registers the experiment's model and promotes it only if it is at least as good as production."""
    cfg = load_section(project, "reprune")
    registry_dir = project / cfg.registry_dir
    registry = ModelRegistry(registry_dir)
    metrics = experiment.metrics()
    candidate = registry.register_pipeline_model(
        experiment.root,
        {
            "data": data,
            "experiment": experiment.name,
            "git_revision": git_revision(project),
            "reason": reason,
            "params": read_params(experiment.root / "params.yaml"),
            "metrics": metrics.get("benchmark", {}),
        },
    )
    production = registry.production()
    decision = decide_candidate(project, experiment.layout, candidate, production, registry_dir)
    if decision.promote:
        registry.promote(candidate.version, "; ".join(decision.reasons))
    record = {
        "candidate_version": candidate.version,
        "experiment": experiment.name,
        "production_version_before": production.version if production else None,
        "promoted": decision.promote,
        "reason": reason,
        **decision.to_dict(),
    }
    dump_json(record, registry_dir / "decisions" / f"{candidate.version}.json")
    return record


@flow(name="reprune", log_prints=True)
def reprune(data_path: str | None = None, project_dir: str = ".", reason: str = "manual") -> dict[str, Any]:
    """Re-prunes on new data and promotes the candidate only if it is at least as good.

    Args:
        data_path: New labelled data (NPZ or table); default: the serving app's feedback (NPZ, or
            CSV of texts for a text project).
        project_dir: The PruneOps project.
        reason: Why this run started (schedule, drift alert, manual), kept with the decision.

    Returns:
        The decision (also in `<registry>/decisions/<version>.json` and a Prefect artifact);
        `{"skipped": ...}` when another flow is running stages in the project.
    """
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    cfg = load_section(project, "reprune")
    try:
        with project_lock(project, "reprune"):
            if data_path is None:
                feedback = default_feedback(project, cfg.feedback_dir)
                if not feedback.exists():
                    raise FileNotFoundError(f"no data_path given and no feedback data at {feedback}")
                data_path = str(feedback)
            data = version_data(str(project), data_path)
            name = f"reprune-{time.strftime('%Y%m%d-%H%M%S')}-{time.monotonic_ns() % 10**6}"
            experiment = run_experiment_task(str(project), dataset_overrides(project, data["path"]), name)
            try:
                record = gate(project, experiment, data, reason)
            finally:
                experiment.remove()  # the model is in the registry; the outputs in the DVC cache
    except LockHeld as exc:
        logger.warning("skipped: %s", exc)
        return {"skipped": str(exc)}
    create_markdown_artifact(
        f"# Re-prune decision: {'PROMOTED' if record['promoted'] else 'kept production'}\n\n"
        + "\n".join(f"- {r}" for r in record["reasons"])
        + f"\n\n```json\n{json.dumps(record, indent=2, default=str)[:4000]}\n```\n",
        key="reprune-decision",
    )
    logger.info("decision: %s", "promote" if record["promoted"] else "keep production")
    return record
