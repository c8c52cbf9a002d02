"""Plan trials: a latency allocation's shortlist ranked by brief training (NetAdapt's short-term fine-tuning)."""

from __future__ import annotations

import copy
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from pruneops.config import PruneConfig
from pruneops.data import Split
from pruneops.models.forward import predict_logits
from pruneops.pipeline.compute import Backend
from pruneops.planning.latency_allocation import PlanOption
from pruneops.pruning.units import unit_sizes
from pruneops.training.fit import FitSettings, calibration_subset, fit_, recalibrate_batchnorm_

logger = logging.getLogger(__name__)


TRIAL_BN_SAMPLES = 1024  # training images a trial's pruned copy re-estimates BatchNorm on

TRIAL_EVIDENCE = 2.0  # standard errors by which a trial must beat the allocation's own plan to replace it


@dataclass
class PlanTrials:
    """Ranks a latency allocation's shortlist by brief training (`prune.trials.count`); each plan once.

    Each plan is pruned into a copy of the trained model by the configured method, BatchNorm is
    recalibrated, one pass over the first `prune.trials.samples` training samples trains it (the
    prune stage's lr and batch size, one seed for every plan, so that the plans differ only in their
    widths), and its validation accuracy ranks it: NetAdapt's short-term fine-tuning.

    The allocation's own plan (the least summed drop, first) is given up only for a plan that
    validates better by more than `TRIAL_EVIDENCE` standard errors of the paired difference on the
    same validation samples: on a few hundred samples one image decides a ranking
    (docs/explanation/latency-targets.md#plan-trials).
    """

    config: PruneConfig
    model: torch.nn.Module
    make_method: Callable[[float, dict | None], object]
    example: torch.Tensor
    train: Split
    val: Split
    backend: Backend | None = (
        None  # runs a shortlist's new trials at once (`pruneops.pipeline.compute`); None: one by one
    )
    records: list[dict] = dataclasses.field(default_factory=list)
    _correct: dict[tuple, np.ndarray] = dataclasses.field(default_factory=dict)
    _calibration: np.ndarray | dict | None = None  # the same BatchNorm samples for every plan, drawn once

    def __call__(self, options: tuple[PlanOption, ...]) -> int:
        """The index of the plan to keep (see the class docstring)."""
        trained = len(self.records)
        if self.backend is not None:
            self._train_new(options)
        correct = [self.correct(o) for o in options]
        best = max(range(len(options)), key=lambda i: (correct[i].mean(), -i))
        gain, error = paired_gain(correct[best], correct[0])
        chosen = best if gain > TRIAL_EVIDENCE * error else 0
        # "2u": the second plan of the shortlist, the uniform cut.
        shown = (
            f"{i + 1}{'u' if o.uniform else ''} {100 * c.mean():.2f}%"
            for i, (o, c) in enumerate(zip(options, correct, strict=True))
        )
        # The loop asks again at each step along the staircase: a shortlist tried before is not news.
        logger.log(
            logging.INFO if len(self.records) > trained else logging.DEBUG,
            "plan trials (validation accuracy): %s; best %d, %+.2f pt over 1 (standard error %.2f): planned %d",
            ", ".join(shown),
            best + 1,
            100 * gain,
            100 * error,
            chosen + 1,
        )
        return chosen

    def correct(self, option: PlanOption) -> np.ndarray:
        """Which validation samples the plan gets right after its trial (trained on first sight)."""
        key = _key(option)
        if key not in self._correct:
            self._record(option, _plan_trial(*self._shared(), option.ratios, len(self.records) + 1))
        return self._correct[key]

    def _train_new(self, options: tuple[PlanOption, ...]) -> None:
        """Trains the shortlist's plans not seen before on the backend, all at once, in order."""
        new = list({_key(o): o for o in options if _key(o) not in self._correct}.values())
        jobs = [(o.ratios, len(self.records) + 1 + i) for i, o in enumerate(new)]
        for option, result in zip(new, self.backend.map(_plan_trial, jobs, self._shared(), "plan trials"), strict=True):
            self._record(option, result)

    def _shared(self) -> tuple:
        """What every trial shares: the model, how to prune it, its data and training settings."""
        if self._calibration is None:
            self._calibration = calibration_subset(self.train.x, TRIAL_BN_SAMPLES, self.config.seed)
        settings = FitSettings(1, self.config.batch_size, self.config.lr, 1e-4, 2, self.config.seed)
        subset = self.train.head(min(self.config.trials.samples, len(self.train)))
        return self.model, self.make_method, self._calibration, subset, self.val, settings, self.example

    def _record(self, option: PlanOption, result: tuple[np.ndarray, dict, float]) -> None:
        correct, widths, seconds = result
        self._correct[_key(option)] = correct
        self.records.append(
            {
                "trial": len(self.records) + 1,
                "widths": widths,  # as the method pruned them
                "uniform": option.uniform,
                "summed_isolated_drop": option.summed_isolated_drop,
                "val_accuracy": float(correct.mean()),
                "seconds": seconds,
            }
        )


def _key(option: PlanOption) -> tuple:
    return tuple(sorted(option.widths.items()))


def _plan_trial(
    model: torch.nn.Module,
    make_method: Callable[[float, dict | None], object],
    calibration: np.ndarray | dict | None,
    subset: Split,
    val: Split,
    settings: FitSettings,
    example: torch.Tensor,
    ratios: dict[str, float],
    number: int,
) -> tuple[np.ndarray, dict, float]:
    """One plan pruned into a copy of `model` and trained briefly: per-sample correctness, widths, seconds."""
    started = time.perf_counter()
    twin = copy.deepcopy(model)
    make_method(max(ratios.values(), default=0.0), ratios).apply_(twin, 1.0)
    recalibrate_batchnorm_(twin, calibration)
    fit_(twin, subset, val, settings, desc=f"plan trial {number}")
    correct = predict_logits(twin, val.x).argmax(1).numpy() == val.y
    return correct, unit_sizes(twin, example), time.perf_counter() - started


def paired_gain(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """Mean of `a - b` (per-sample correctness on the same samples) and its standard error."""
    d = a.astype(float) - b.astype(float)
    return float(d.mean()), float(d.std(ddof=1) / np.sqrt(len(d))) if len(d) > 1 else 0.0


def trial_records(trials: PlanTrials | None, plans: tuple[dict, ...] | None) -> tuple[dict, ...] | None:
    """The plans trialled, each marked whether the loop measured it and whether it was kept."""
    if trials is None or not trials.records:
        return None
    measured = {tuple(sorted(p["widths"].items())): p for p in plans or ()}

    def mark(record: dict) -> dict:
        hit = measured.get(tuple(sorted(record["widths"].items())))
        return {**record, "measured": hit is not None, "kept": bool(hit and hit["kept"])}

    return tuple(mark(r) for r in trials.records)
