"""The quality budget: a model's change against dense, with its paired interval, held at the interval's far end.

One rule for both tasks. A classifier's change is in accuracy points (paired bootstrap over the
same samples); a causal LM's in relative perplexity (the ratio minus one, paired bootstrap over the
same blocks). A budget holds when the far end of the 95 % interval, the worst the model may
really be, is within it: a lucky draw of a small validation split never passes a model that loses
on test. The stages that decide what ships (`quantize`) and the promotion of a re-prune read it.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Literal

import numpy as np

Unit = Literal["points", "perplexity"]
RESAMPLES = 2000


@dataclass(frozen=True)
class QualityChange:
    """A model's quality against dense fp32 on one split: the change and its 95 % paired interval.

    `points`: accuracy points (negative is worse). `perplexity`: relative perplexity change, the
    ratio minus one (positive is worse).
    """

    value: float
    low: float
    high: float
    unit: Unit
    samples: int

    @property
    def worst(self) -> float:
        """The far end of the interval on the side of a loss, as a loss (positive: worse than dense)."""
        return -self.low if self.unit == "points" else self.high

    def text(self) -> str:
        """`-0.46 pts [-1.39, +0.00]` or `+6.6 % [+0.9, +12.9]` (perplexity)."""
        if self.unit == "points":
            return f"{self.value:+.2f} pts [{self.low:+.2f}, {self.high:+.2f}]"
        return f"{100 * self.value:+.1f} % [{100 * self.low:+.1f}, {100 * self.high:+.1f}]"

    def record(self) -> dict:
        """JSON-ready."""
        return asdict(self)


def changes_beyond_corpus(row: dict) -> list[str]:
    """`["general text +239.2 % [...]", "zero-shot -9.00 pts [...]"]`: a decoder row's changes beyond its corpus.

    Reads a report row, results record or quantize candidate's `general_change` and `zero_shot_change`
    (`QualityChange` records), where set.
    """
    parts = (("general_change", "general text"), ("zero_shot_change", "zero-shot"))
    return [f"{what} {QualityChange(**row[key]).text()}" for key, what in parts if row.get(key)]


def beyond_corpus(row: dict) -> str:
    """`; general text +239.2 % [...]; zero-shot -9.00 pts [...]`: `changes_beyond_corpus`, each after `; `."""
    return "".join(f"; {change}" for change in changes_beyond_corpus(row))


def accuracy_change(correct: np.ndarray, dense_correct: np.ndarray, seed: int = 0) -> QualityChange:
    """Accuracy points against dense and their 95 % interval, resampling the same samples for both."""
    a, b = np.asarray(correct, dtype=np.float64), np.asarray(dense_correct, dtype=np.float64)
    index = np.random.default_rng(seed).integers(0, len(a), size=(RESAMPLES, len(a)))
    draws = 100 * (a[index].mean(1) - b[index].mean(1))
    low, high = np.percentile(draws, [2.5, 97.5])
    return QualityChange(float(100 * (a.mean() - b.mean())), float(low), float(high), "points", len(a))


def perplexity_change(losses: np.ndarray, dense_losses: np.ndarray, seed: int = 0) -> QualityChange:
    """Relative perplexity against dense (ratio - 1) and its 95 % interval, resampling the same blocks for both."""
    a, b = np.asarray(losses, dtype=np.float64), np.asarray(dense_losses, dtype=np.float64)
    index = np.random.default_rng(seed).integers(0, len(a), size=(RESAMPLES, len(a)))
    draws = np.exp(a[index].mean(1) - b[index].mean(1)) - 1
    low, high = np.quantile(draws, [0.025, 0.975])
    return QualityChange(math.exp(a.mean() - b.mean()) - 1, float(low), float(high), "perplexity", len(a))


@dataclass(frozen=True)
class QualityBudget:
    """How much quality a model may lose against dense: a loss in the change's unit, or None (not gated)."""

    limit: float | None
    unit: Unit

    def holds(self, change: QualityChange) -> bool:
        """Whether the interval's far end is within the budget (always, without one)."""
        return self.limit is None or change.worst <= self.limit + 1e-12

    def text(self) -> str:
        """`1.0 pts` or `+10 % perplexity`, or `none`."""
        if self.limit is None:
            return "none"
        return f"{self.limit:g} pts" if self.unit == "points" else f"+{100 * self.limit:g} % perplexity"

    def verdict(self, change: QualityChange) -> str:
        """One line: the change, its interval, and whether it holds."""
        state = "within" if self.holds(change) else "outside"
        return f"{change.text()} on {change.samples} validation samples: {state} the {self.text()} budget"


class ModelSource(StrEnum):
    """Whose model a quantize stage ships, or a row of a report holds (its value is what files hold)."""

    PRUNED = "pruned"
    DENSE = "dense"  # dense's own, where the pruned model was outside the budget or no faster (`DenseShips`)

    @classmethod
    def read(cls, value: str | None) -> ModelSource:
        """The source a file names; one without (written before dense could ship in its place): the pruned model."""
        return cls(value) if value else cls.PRUNED


class DenseShips(StrEnum):
    """Why a quantize stage shipped dense in place of the pruned model (its value is what files hold)."""

    OUTSIDE_BUDGET = "outside_budget"  # no form of the pruned model within the quality budgets
    SLOWER_ELSEWHERE = "slower_elsewhere"  # those within were too slow in the other metric
    NOT_FASTER = "not_faster"  # those within were no faster than dense's fastest form within them

    @classmethod
    def read(cls, value: str | None) -> DenseShips:
        """The reason a file names; one without (written before reasons were recorded): outside the budget."""
        return cls(value) if value else cls.OUTSIDE_BUDGET

    @property
    def why(self) -> str:
        """`the pruned model was outside the budget`: the reason as a row of a report says it."""
        return _DENSE_SHIPS_WORDS[self][0]

    @classmethod
    def of_row(cls, row: dict) -> DenseShips | None:
        """Why a bench row of a pruned recipe holds dense's model (its quantize stage shipped dense); None: it doesn't.

        The row's `source` is `dense` where it holds dense's model, `family` its recipe's family
        (`dense` for dense's own rows), `deployed` whether it is what the recipe ships (a row without it:
        a selection's pick, which is).
        """
        shipped = row.get("source") == ModelSource.DENSE and row.get("family") != "dense" and row.get("deployed", True)
        return cls.read(row.get("dense_ships")) if shipped else None

    @property
    def for_a_selection(self) -> str:
        """`no cut held every budget`: the reason as a benchmark's selection says it."""
        return _DENSE_SHIPS_WORDS[self][1]


_DENSE_SHIPS_WORDS: dict[DenseShips, tuple[str, str]] = {  # (a report's row, a benchmark's selection)
    DenseShips.OUTSIDE_BUDGET: ("the pruned model was outside the budget", "no cut held every budget"),
    DenseShips.SLOWER_ELSEWHERE: (
        "the pruned model's forms within the budget were too slow in the other metric",
        "every cut within the budgets too slow in the other metric",
    ),
    DenseShips.NOT_FASTER: (
        "no form of the pruned model within the budget was faster",
        "no cut within every budget was faster",
    ),
}
