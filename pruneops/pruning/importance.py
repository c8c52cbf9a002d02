"""Importance criteria for channel groups (Torch-Pruning callables) and attention heads."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch_pruning as tp

from pruneops.core.errors import PruneOpsError
from pruneops.core.plugins import Registry


@dataclass(frozen=True)
class Criterion:
    """A channel-group importance factory, a head scorer, and whether gradients are needed."""

    name: str
    make_group_importance: Callable[[], Callable]
    head_scores: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]
    needs_grad: bool = False
    # False when the criterion has no meaning for attention heads (they are then ranked by L2,
    # and the stage records that it did so).
    scores_heads: bool = True


IMPORTANCES: Registry[Criterion] = Registry("importance criterion")


def _l1(w: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return w.abs().sum(1)


def _l2(w: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return w.pow(2).sum(1).sqrt()


def _taylor(w: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    if g is None:
        raise PruneOpsError("importance 'taylor' needs gradients, and the attention heads have none")
    return (w * g).abs().sum(1)


def _random(w: torch.Tensor, g: torch.Tensor | None) -> torch.Tensor:
    return torch.rand(w.shape[0])


IMPORTANCES.register("l1", "L1 norm of each group's weights")(
    Criterion("l1", lambda: tp.importance.GroupMagnitudeImportance(p=1), _l1)
)
IMPORTANCES.register("l2", "L2 norm of each group's weights")(
    Criterion("l2", lambda: tp.importance.GroupMagnitudeImportance(p=2), _l2)
)
IMPORTANCES.register("taylor", "first-order Taylor |w * dL/dw| (needs a gradient pass)")(
    Criterion("taylor", lambda: tp.importance.GroupTaylorImportance(), _taylor, needs_grad=True)
)
IMPORTANCES.register("bn_scale", "|gamma| of the BatchNorm that follows (units without one: L2, with a warning)")(
    Criterion("bn_scale", lambda: tp.importance.BNScaleImportance(), _l2, scores_heads=False)
)
IMPORTANCES.register("random", "random scores (a baseline to beat)")(
    Criterion("random", lambda: tp.importance.RandomImportance(), _random)
)
