"""Exported decoders as rows of a benchmark: timed interleaved across runtimes, scored against dense fp32.

What the pipeline's `benchmark` stage does with the export's manifest and `pruneops bench` with
every variant's: time each row at batch 1 and each benchmark batch size (all runtimes in one
process, round by round; a runtime that times fewer sequences at once sits a batch out), score
each on the corpus's blocks and on the zero-shot check's reported half (a model that is two rows,
the same runtime and files, scored once), and give each row's change against dense fp32 with its
paired interval.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np

from pruneops.config import BenchmarkConfig
from pruneops.core.integrity import folder_manifest
from pruneops.core.progress import progress
from pruneops.core.quality import accuracy_change, perplexity_change
from pruneops.data.zero_shot import zero_shot_correct
from pruneops.runtimes.base import Runtime
from pruneops.task.causal_lm.common import _timed

T = TypeVar("T")
Models = Mapping[str, tuple[Runtime, Path]]


def time_rows(models: Models, config: BenchmarkConfig) -> dict[str, dict[str, float]]:
    """Each row's `ttft_b{n}_ms` and `tpot_b{n}_ms` at batch 1 and each of `config.batch_sizes`, timed interleaved.

    The prompts are random tokens of the first row's vocabulary (dense fp32's). A runtime that
    times fewer sequences at once than a batch sits that batch out (its row has no figures there).
    """
    runtime, folder = next(iter(models.values()))
    vocab = runtime.open(folder).vocab_size
    figures: dict[str, dict[str, float]] = {name: {} for name in models}
    for batch in sorted({1, *config.batch_sizes}):
        here = {n: m for n, m in models.items() if m[0].max_batch is None or batch <= m[0].max_batch}
        for name, timing in _timed(here, vocab, batch, config).items():
            figures[name][f"ttft_b{batch}_ms"] = timing.ttft_ms
            figures[name][f"tpot_b{batch}_ms"] = timing.tpot_ms
    return figures


@dataclass(frozen=True)
class RowScores:
    """One row's per-block losses on each split scored, and its answers to the zero-shot check (right or not)."""

    losses: dict[str, np.ndarray]
    zero_shot: np.ndarray | None


def score_rows(models: Models, blocks: dict[str, np.ndarray], check: dict | None, what: str) -> dict[str, RowScores]:
    """Every row scored by its own exported logits on `blocks` and on `check`'s reported half (None: no check).

    Rows with the same runtime and files (`same_files`: what ships where the gate backed off to
    dense) are scored once. `what` names the step in the progress log.
    """
    first_of = same_files(models)
    distinct = {name: models[name] for name in dict.fromkeys(first_of.values())}
    scores = {}
    for name, (runtime, folder) in progress(distinct.items(), f"{what}: scoring", len(distinct), "models"):
        model = runtime.open(folder, threads=2)
        losses = {split: model.losses(b) for split, b in blocks.items()}
        scores[name] = RowScores(losses, zero_shot_correct(model, check, "zero_shot") if check else None)
    return _per_row(scores, first_of)


def quality_figures(scores: dict[str, RowScores], dense: str) -> dict[str, dict]:
    """Each row's `{split}_perplexity` and `{split}_change` against `dense`, and its zero-shot accuracy and change.

    Changes are paired on the same blocks (items), as `QualityChange` records.
    """
    reference = scores[dense]
    figures = {}
    for name, s in scores.items():
        f: dict = {}
        for split, nll in s.losses.items():
            f[f"{split}_perplexity"] = float(np.exp(nll.mean()))
            f[f"{split}_change"] = perplexity_change(nll, reference.losses[split]).record()
        if s.zero_shot is not None and reference.zero_shot is not None:
            f["zero_shot_accuracy"] = float(s.zero_shot.mean())
            f["zero_shot_change"] = accuracy_change(s.zero_shot, reference.zero_shot).record()
        figures[name] = f
    return figures


def same_files(models: Models) -> dict[str, str]:
    """Each row -> the first row whose runtime and files (`folder_manifest`: names and SHA-256) are its own."""
    keys = {name: (runtime.name, folder_manifest(folder)) for name, (runtime, folder) in models.items()}
    return {name: next(first for first in models if keys[first] == key) for name, key in keys.items()}


def _per_row(scores: dict[str, T], same: dict[str, str]) -> dict[str, T]:
    """Scores of the distinct rows given to every row (`same_files`), in the rows' order."""
    return {name: scores[first] for name, first in same.items()}
