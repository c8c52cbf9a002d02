"""The re-prune gate's evaluation: a candidate against production on recent and held-out data.

Classifiers by accuracy and batch-1 latency (`decide_promotion`), decoder LLMs by perplexity of
their own exported logits (recent, held-out and general text), the zero-shot check where `validate`
has one, time per output token and time to first token (`decide_decoder_promotion`); the held-out
set is frozen in the registry the first time it is needed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import numpy as np

from pruneops.core.io import Layout
from pruneops.data import Split, load_split
from pruneops.data.zero_shot import read_zero_shot
from pruneops.modelstore.decoder import is_decoder_version
from pruneops.modelstore.promotion import (
    PromotionDecision,
    decide_decoder_promotion,
    decide_promotion,
    evaluate_decoders,
    evaluate_onnx,
)
from pruneops.modelstore.store import ModelVersion
from pruneops.pipeline.stages import load_section


def holdout_split(registry_dir: Path, fallback: Layout) -> Split:
    """The frozen held-out test set: copied once (from the workspace's own test split when it has one)."""
    holdout = registry_dir / "holdout"
    if not (holdout / "test.npz").exists():
        holdout.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fallback.stage_dir("validate") / "test.npz", holdout / "test.npz")
    return load_split(holdout, "test")


def holdout_blocks(registry_dir: Path, fallback: Layout) -> np.ndarray:
    """A decoder's frozen held-out test blocks: copied once from the workspace's corpus."""
    holdout = registry_dir / "holdout" / "corpus.npz"
    if not holdout.exists():
        holdout.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(fallback.stage_dir("validate") / "corpus.npz", holdout)
    with np.load(holdout) as npz:
        return npz["test"].astype(np.int64)


def decoder_datasets(experiment: Layout, holdout: np.ndarray) -> dict[str, np.ndarray]:
    """What a decoder candidate and production are scored on: recent blocks, the frozen held-out ones, general text.

    `general` (the reported half of `validate.general_text`, where the experiment's corpus has one)
    holds a re-pruned model to production's perplexity on text beyond the corpus as well.
    """
    with np.load(experiment.stage_dir("validate") / "corpus.npz") as npz:
        general = {"general": npz["general"].astype(np.int64)} if "general" in npz else {}
        return {"recent": npz["test"].astype(np.int64), "holdout": holdout, **general}


def _decoder_decision(
    project: Path, experiment: Layout, candidate: ModelVersion, production: ModelVersion | None, registry_dir: Path
) -> PromotionDecision:
    """Candidate and production scored on recent and held-out blocks and timed interleaved: the decision."""
    cfg, bench = load_section(project, "reprune"), load_section(project, "benchmark")
    workspace = Layout(project)
    source = workspace if (workspace.stage_dir("validate") / "corpus.npz").exists() else experiment
    datasets = decoder_datasets(experiment, holdout_blocks(registry_dir, source))
    folders = {"candidate": candidate.path, **({"production": production.path} if production else {})}
    zero_shot = read_zero_shot(experiment.stage_dir("validate"))
    evaluations = evaluate_decoders(folders, datasets, bench.prompt_length, bench.new_tokens, bench.rounds, zero_shot)
    return decide_decoder_promotion(
        evaluations["candidate"],
        evaluations.get("production"),
        cfg.perplexity_tolerance,
        cfg.decode_slo_ms,
        cfg.prefill_slo_ms,
        cfg.zero_shot_tolerance,
    )


def _classifier_decision(
    project: Path, experiment: Layout, candidate: ModelVersion, production: ModelVersion | None, registry_dir: Path
) -> PromotionDecision:
    """Candidate and production evaluated on recent and held-out data: the decision."""
    cfg = load_section(project, "reprune")
    workspace = Layout(project)
    source = workspace if (workspace.stage_dir("validate") / "test.npz").exists() else experiment
    datasets = {
        "recent": load_split(experiment.stage_dir("validate"), "test"),
        "holdout": holdout_split(registry_dir, source),
    }
    cand_eval = evaluate_onnx(candidate.model_file, datasets, cfg.latency_repeats)
    prod_eval = evaluate_onnx(production.model_file, datasets, cfg.latency_repeats) if production else None
    return decide_promotion(cand_eval, prod_eval, cfg.accuracy_tolerance, cfg.latency_slo_ms)


def decide_candidate(
    project: Path, experiment: Layout, candidate: ModelVersion, production: ModelVersion | None, registry_dir: Path
) -> PromotionDecision:
    """Whether `candidate` (the experiment's registered model) replaces `production`, and why."""
    decide = _decoder_decision if is_decoder_version(candidate.metadata) else _classifier_decision
    return decide(project, experiment, candidate, production, registry_dir)
