"""`reprune`: version new data, re-run the pipeline, promote the candidate only if it is as good."""

from __future__ import annotations

import json
import os
import shutil
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from prefect import flow, get_run_logger, task
from prefect.artifacts import create_markdown_artifact

from flows.pipeline import pruning_pipeline
from pruneops.config import read_params
from pruneops.data import Split, load_split
from pruneops.io import dump_json
from pruneops.model_registry import ModelRegistry, git_revision
from pruneops.promotion import decide_promotion, evaluate_onnx
from tasks.params import reprune_config
from tasks.stages import run_streamed

LOCK_NAME = ".reprune.lock"
STALE_LOCK_S = 6 * 3600


@contextmanager
def reprune_lease(registry_dir: Path):
    """Yields True for the one run that holds the lease, False for any run started meanwhile."""
    registry_dir.mkdir(parents=True, exist_ok=True)
    lock = registry_dir / LOCK_NAME
    if lock.exists() and time.time() - lock.stat().st_mtime > STALE_LOCK_S:
        lock.unlink(missing_ok=True)  # left by a run that died
    try:
        fd = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:
        yield False
        return
    try:
        os.write(fd, f"{os.getpid()} {time.time()}\n".encode())
        os.close(fd)
        yield True
    finally:
        lock.unlink(missing_ok=True)


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
    code, tail = run_streamed(["dvc", "add", str(source.relative_to(project))], str(project), get_run_logger())
    if code != 0:
        raise RuntimeError(f"dvc add {source} failed: {tail[-1] if tail else ''}")
    meta = Path(f"{source}.dvc").read_text()
    md5 = next((line.split(":", 1)[1].strip() for line in meta.splitlines() if "md5:" in line), "")
    return {"path": str(source.relative_to(project)), "md5": md5}


def dataset_overrides(path: str) -> dict[str, Any]:
    """Params that point `validate` at a data file (NPZ, or CSV/Parquet tables)."""
    kind = "npz" if path.endswith(".npz") else "table"
    return {"validate.dataset": kind, "validate.path": path}


def holdout_split(registry_dir: Path, project: Path) -> Split:
    """The frozen held-out test set: copied from the first run's test split, then never changed."""
    holdout = registry_dir / "holdout"
    if not (holdout / "test.npz").exists():
        holdout.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(project / "artifacts" / "validate" / "test.npz", holdout / "test.npz")
    return load_split(holdout, "test")


@flow(name="reprune", log_prints=True)
def reprune(data_path: str | None = None, project_dir: str = ".", reason: str = "manual") -> dict[str, Any]:
    """Re-prunes on new data and promotes the candidate only if it is at least as good.

    Args:
        data_path: New labelled data (NPZ or table); default: the serving app's feedback NPZ.
        project_dir: The PruneOps project.
        reason: Why this run started (schedule, drift alert, manual), kept with the decision.

    Returns:
        The decision (also in `<registry>/decisions/<version>.json` and a Prefect artifact);
        `{"skipped": ...}` when another re-prune holds the lease.
    """
    logger = get_run_logger()
    project = Path(project_dir).resolve()
    cfg = reprune_config(project)
    registry_dir = project / cfg.registry_dir
    with reprune_lease(registry_dir) as held:
        if not held:
            logger.warning("skipped: a re-prune is already running")
            return {"skipped": "a re-prune is already running"}
        if data_path is None:
            feedback = project / cfg.feedback_dir / "feedback.npz"
            if not feedback.exists():
                raise FileNotFoundError(f"no data_path given and no feedback data at {feedback}")
            data_path = str(feedback)
        data = version_data(str(project), data_path)
        metrics = pruning_pipeline(dataset_overrides(data["path"]), str(project))
        registry = ModelRegistry(registry_dir)
        candidate = registry.register_pipeline_model(
            project,
            {
                "data": data,
                "git_revision": git_revision(project),
                "reason": reason,
                "params": read_params(project / "params.yaml"),
                "metrics": metrics["benchmark"],
            },
        )
        datasets = {
            "recent": load_split(project / "artifacts" / "validate", "test"),
            "holdout": holdout_split(registry_dir, project),
        }
        cand_eval = evaluate_onnx(candidate.model_file, datasets, cfg.latency_repeats)
        production = registry.production()
        prod_eval = evaluate_onnx(production.model_file, datasets, cfg.latency_repeats) if production else None
        decision = decide_promotion(cand_eval, prod_eval, cfg.accuracy_tolerance, cfg.latency_slo_ms)
        if decision.promote:
            registry.promote(candidate.version, "; ".join(decision.reasons))
        record = {
            "candidate_version": candidate.version,
            "production_version_before": production.version if production else None,
            "promoted": decision.promote,
            "reason": reason,
            **decision.to_dict(),
        }
        dump_json(record, registry_dir / "decisions" / f"{candidate.version}.json")
        create_markdown_artifact(
            f"# Re-prune decision: {'PROMOTED' if decision.promote else 'kept production'}\n\n"
            + "\n".join(f"- {r}" for r in decision.reasons)
            + f"\n\n```json\n{json.dumps(record, indent=2, default=str)[:4000]}\n```\n",
            key="reprune-decision",
        )
        logger.info("decision: %s", "promote" if decision.promote else "keep production")
        return record
