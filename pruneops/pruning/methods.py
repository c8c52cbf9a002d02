"""Pruning methods, chosen by `prune.method` through `METHODS`.

A method is a class with `apply_(model, fraction)` (prune to `fraction` of the target, the
schedule's point), `after_step(model)` (called after every optimizer step while fine-tuning),
`masks()` (what to save beside the weights) and `speedup` (what hardware can gain from it).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pruneops.data.splits import Split
from pruneops.models import classifier_of
from pruneops.pruning.importance import Criterion
from pruneops.pruning.units import UnitPruner, round_keep
from pruneops.registry import Registry


@dataclass
class PruneContext:
    """What every method may use.

    Args:
        target_ratio: The final fraction to remove.
        criterion: Importance criterion.
        example_input: A batch of one sample, for tracing.
        train: Training data (for gradient-based importance).
        allocation: Per-unit final ratios from sensitivity analysis (None: uniform).
        round_to: Keep channel counts multiples of this.
    """

    target_ratio: float
    criterion: Criterion
    example_input: torch.Tensor
    train: Split
    allocation: dict[str, float] | None = None
    round_to: int | None = None
    grad_batches: int = 4
    batch_size: int = 64


def accumulate_grads_(model: nn.Module, data: Split, batches: int, batch_size: int) -> None:
    """Leaves the summed gradients of the loss over a few training batches in `.grad`."""
    model.zero_grad(set_to_none=True)
    model.eval()
    for i in range(batches):
        xb = torch.from_numpy(data.x[i * batch_size : (i + 1) * batch_size])
        yb = torch.from_numpy(data.y[i * batch_size : (i + 1) * batch_size])
        if len(yb) == 0:
            break
        F.cross_entropy(model(xb), yb).backward()


class PruningMethod:
    """Base class: no masks, nothing to do between optimizer steps."""

    structured = False
    speedup = ""

    def __init__(self, ctx: PruneContext):
        self.ctx = ctx

    def apply_(self, model: nn.Module, fraction: float) -> None:
        """Prunes `model` in place to `fraction` (0..1] of the target."""
        raise NotImplementedError

    def after_step(self, model: nn.Module) -> None:
        """Keeps pruned weights pruned while fine-tuning."""

    def masks(self) -> dict[str, torch.Tensor]:
        """Masks to save beside the weights (name -> bool tensor)."""
        return {}


METHODS: Registry[Callable[[PruneContext], PruningMethod]] = Registry("pruning method")


@METHODS.register("channel", "structured channel/head removal: smaller dense layers (real speed-up)")
class ChannelPruning(PruningMethod):
    """Dependency-aware channel (and attention-head) removal via Torch-Pruning's DepGraph."""

    structured = True
    speedup = "real: layers become smaller dense matrices"

    def __init__(self, ctx: PruneContext):
        super().__init__(ctx)
        self.original: dict[str, int] = {}

    def apply_(self, model: nn.Module, fraction: float) -> None:
        pruner = UnitPruner(model, self.ctx.example_input, self.ctx.criterion)
        if not self.original:
            self.original = {n: u.size for n, u in pruner.units().items()}
        ratios = self.ctx.allocation or dict.fromkeys(self.original, self.ctx.target_ratio)
        keep = {}
        for name, size in self.original.items():
            round_to = self.ctx.round_to if not name.endswith(".heads") else None
            keep[name] = round_keep(size, ratios.get(name, 0.0) * fraction, round_to)
        if self.ctx.criterion.needs_grad:
            accumulate_grads_(model, self.ctx.train, self.ctx.grad_batches, self.ctx.batch_size)
        pruner.prune_to_(keep)
        model.zero_grad(set_to_none=True)


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zeroes the masked-out entries of the named parameters (mask True = keep)."""
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        params[name].mul_(mask)


def prunable_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Weights of every Linear/Conv layer except the classifier, by parameter name."""
    head = classifier_of(model)
    return {
        f"{n}.weight": m.weight
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) and m is not head
    }


@METHODS.register("magnitude", "global unstructured magnitude: zeros in dense layers (no CPU speed-up)")
class MagnitudePruning(PruningMethod):
    """Global unstructured magnitude pruning with masks kept apart from the weights."""

    speedup = "none through dense kernels: zeros are multiplied like any other weight"

    def __init__(self, ctx: PruneContext):
        super().__init__(ctx)
        self._masks: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def apply_(self, model: nn.Module, fraction: float) -> None:
        weights = prunable_weights(model)
        flat = torch.cat([w.detach().abs().flatten() for w in weights.values()])
        k = int(round(self.ctx.target_ratio * fraction * flat.numel()))
        keep = torch.ones_like(flat, dtype=torch.bool)
        keep[torch.argsort(flat)[:k]] = False
        offset = 0
        for name, w in weights.items():
            self._masks[name] = keep[offset : offset + w.numel()].view_as(w).clone()
            offset += w.numel()
        self.after_step(model)

    def after_step(self, model: nn.Module) -> None:
        apply_masks_(model, self._masks)

    def masks(self) -> dict[str, torch.Tensor]:
        return dict(self._masks)
