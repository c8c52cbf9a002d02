"""Pruning methods, chosen by `prune.method` through `METHODS`.

A method is a class with `apply_(model, fraction)` (prune to `fraction` of the target, the
schedule's point), `after_backward(model)` / `after_step(model)` (called while fine-tuning),
`masks()` (what to save beside the weights) and `speedup` (what hardware can gain from it).
Structured methods shrink layers; unstructured ones keep masks beside dense weights. Each class
declares which `prune` keys apply to it (`options`), which it needs (`required`) and which
importance criteria it understands (`importances`, empty for any); config loading enforces them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from pruneops.core.inputs import as_tensors, rows, run_model, trim_padding
from pruneops.core.plugins import Registry
from pruneops.data.splits import Split
from pruneops.models import classifier_of
from pruneops.pruning.fisher import FISHER_SCORES_FILE, fisher_scores, load_fisher_scores
from pruneops.pruning.heads import gate_importance, head_sites
from pruneops.pruning.importance import Criterion
from pruneops.pruning.masks import apply_masks_
from pruneops.pruning.units import UnitPruner, keep_count


@dataclass
class PruneContext:
    """What every method may use.

    Args:
        target_ratio: The final fraction to remove.
        criterion: Importance criterion.
        example_input: A batch of one sample, for tracing.
        train: Training data (for gradient-based importance).
        allocation: Per-unit final ratios from sensitivity analysis (structured methods;
            None: uniform).
        layer_allocation: Per-layer final ratios (unstructured methods; None: uniform).
        scope: "global" (one threshold over all layers) or "layer" (each layer its ratio),
            for unstructured methods.
        round_to: Keep channel counts multiples of this.
    """

    target_ratio: float
    criterion: Criterion
    example_input: torch.Tensor
    train: Split
    allocation: dict[str, float] | None = None
    layer_allocation: dict[str, float] | None = None
    scope: str = "global"
    round_to: int | None = None
    grad_batches: int = 4
    batch_size: int = 64
    warnings: list[str] = field(default_factory=list)
    # (head, channel) scores of the unpruned model from `shared_scores`: used by the first `apply_`,
    # which always sees that model (trial copies included), so they are computed once per stage.
    base_scores: tuple[dict | None, dict | None] | None = None


def accumulate_grads_(model: nn.Module, data: Split, batches: int, batch_size: int) -> None:
    """Leaves the summed gradients of the loss over a few training batches in `.grad`."""
    model.zero_grad(set_to_none=True)
    model.eval()
    for i in range(batches):
        xb = trim_padding(as_tensors(rows(data.x, slice(i * batch_size, (i + 1) * batch_size))))
        yb = torch.from_numpy(data.y[i * batch_size : (i + 1) * batch_size])
        if len(yb) == 0:
            break
        F.cross_entropy(run_model(model, xb), yb).backward()


class PruningMethod:
    """Base class: no masks, nothing to do while fine-tuning."""

    structured = False
    needs_warmup = False
    options: frozenset[str] = frozenset()
    required: frozenset[str] = frozenset()
    importances: frozenset[str] = frozenset()

    def __init__(self, ctx: PruneContext):
        self.ctx = ctx

    @property
    def speedup(self) -> str:
        """What hardware can gain from this method's sparsity."""
        return ""

    @classmethod
    def shared_scores(
        cls, model: nn.Module, ctx: PruneContext, saved_dir: Path | None
    ) -> tuple[dict | None, dict | None] | None:
        """Scores of the unpruned `model` that every trial copy and the first step may share (None: none).

        Args:
            model: The unpruned model.
            ctx: The method's context (data, batch size, criterion).
            saved_dir: The sensitivity stage's output, when it scored this very model.
        """
        return None

    def apply_(self, model: nn.Module, fraction: float) -> None:
        """Prunes `model` in place to `fraction` (0..1] of the target."""
        raise NotImplementedError

    def after_backward(self, model: nn.Module) -> None:
        """Sees the gradients of each fine-tuning batch (e.g. to accumulate scores)."""

    def after_step(self, model: nn.Module) -> None:
        """Keeps pruned weights pruned while fine-tuning."""

    def masks(self) -> dict[str, torch.Tensor]:
        """Masks to save beside the weights (parameter name -> bool tensor, True = kept)."""
        return {}


METHODS: Registry[Callable[[PruneContext], PruningMethod]] = Registry("pruning method")


def registered_methods(_: str = "all") -> dict[str, type[PruningMethod]]:
    """Every registered method class by name (config checks list which methods take a key)."""
    return {entry.name: entry.obj for entry in METHODS}


@METHODS.register("channel", "structured channel/head removal: smaller dense layers (real speed-up)")
class ChannelPruning(PruningMethod):
    """Dependency-aware channel (and attention-head) removal via Torch-Pruning's DepGraph."""

    structured = True
    options = frozenset({"target", "importance", "round_to"})
    required = frozenset({"target", "importance"})

    def __init__(self, ctx: PruneContext):
        super().__init__(ctx)
        self.original: dict[str, int] = {}

    @property
    def speedup(self) -> str:
        return "real: layers become smaller dense matrices"

    def unit_scores(self, model: nn.Module, pruner: UnitPruner) -> tuple[dict | None, dict | None]:
        """Precomputed (head, channel) importance; None ranks by the criterion over the weights."""
        return None, None

    def apply_(self, model: nn.Module, fraction: float) -> None:
        pruner = UnitPruner(model, self.ctx.example_input, self.ctx.criterion)
        first = not self.original
        if first:
            self.original = {n: u.size for n, u in pruner.units().items()}
        ratios = self.ctx.allocation or dict.fromkeys(self.original, self.ctx.target_ratio)
        keep = {n: keep_count(n, s, ratios.get(n, 0.0) * fraction, self.ctx.round_to) for n, s in self.original.items()}
        if self.ctx.criterion.needs_grad:
            accumulate_grads_(model, self.ctx.train, self.ctx.grad_batches, self.ctx.batch_size)
        shared = self.ctx.base_scores if first else None
        head_scores, channel_scores = shared if shared is not None else self.unit_scores(model, pruner)
        pruner.prune_to_(keep, head_scores=head_scores, channel_scores=channel_scores)
        self.ctx.warnings.extend(w for w in pruner.warnings if w not in self.ctx.warnings)
        model.zero_grad(set_to_none=True)


def training_batches(data: Split, batches: int, batch_size: int):
    """The first `batches` (inputs, labels) batches of `data` as tensors."""
    for i in range(0, min(len(data), batches * batch_size), batch_size):
        xb = trim_padding(as_tensors(rows(data.x, slice(i, i + batch_size))))
        yield xb, torch.from_numpy(data.y[i : i + batch_size])


@METHODS.register("head", "attention heads by gate importance (Michel et al. 2019) + FFN neurons")
class HeadPruning(ChannelPruning):
    """Structured removal with heads ranked by the gate importance over training data.

    The gate importance (E|dL/d gate|, normalised per layer) ranks heads; FFN intermediate
    neurons (and any other channel group) are ranked by the criterion.
    """

    def unit_scores(self, model: nn.Module, pruner: UnitPruner) -> tuple[dict | None, dict | None]:
        sites = head_sites(model)
        if not sites:
            return None, None
        batches = training_batches(self.ctx.train, max(self.ctx.grad_batches, 8), self.ctx.batch_size)
        return gate_importance(model, sites, batches), None


@METHODS.register(
    "fisher",
    "heads + FFN neurons ranked by the Fisher information of a mask on them (Kwon et al. 2022); "
    "for retraining-free pruning",
)
class FisherPruning(ChannelPruning):
    """Structured removal ranked by mask Fisher information; no training needed to rank.

    Heads and the channels a Linear consumes (FFN neurons) are ranked by the diagonal Fisher
    information of a mask on them over `CALIBRATION_SAMPLES` training samples (other channel
    groups keep the criterion). With `prune.epochs_per_step: 0` and `finetune.epochs: 0` nothing
    is trained. Kwon et al.'s layer-wise mask tuning (`pruneops.pruning.fisher.reconstruct_linears_`)
    is not applied: fit to each layer's own output, it lowered MiniLM's validation accuracy.
    """

    CALIBRATION_SAMPLES = 2048  # what Kwon et al. use

    @classmethod
    def shared_scores(
        cls, model: nn.Module, ctx: PruneContext, saved_dir: Path | None
    ) -> tuple[dict | None, dict | None] | None:
        """The unpruned model's Fisher scores, computed once for the stage.

        The sensitivity stage's (over `sensitivity.fisher_samples` training samples) when it saved
        them for this model, else computed here over `CALIBRATION_SAMPLES`.
        """
        pruner = UnitPruner(model, ctx.example_input, ctx.criterion)
        sites, consumers = head_sites(model), pruner.linear_consumers()
        saved = load_fisher_scores(saved_dir / FISHER_SCORES_FILE, sites, consumers) if saved_dir else None
        return saved if saved is not None else cls._fisher(model, pruner, ctx)

    def unit_scores(self, model: nn.Module, pruner: UnitPruner) -> tuple[dict | None, dict | None]:
        return self._fisher(model, pruner, self.ctx)

    @classmethod
    def _fisher(cls, model: nn.Module, pruner: UnitPruner, ctx: PruneContext) -> tuple[dict, dict]:
        count = -(-cls.CALIBRATION_SAMPLES // ctx.batch_size)
        batches = training_batches(ctx.train, count, ctx.batch_size)
        return fisher_scores(model, head_sites(model), pruner.linear_consumers(), batches)


def prunable_weights(model: nn.Module) -> dict[str, nn.Parameter]:
    """Weights of every Linear/Conv layer except the classifier, by parameter name."""
    head = classifier_of(model)
    return {
        f"{n}.weight": m.weight
        for n, m in model.named_modules()
        if isinstance(m, (nn.Linear, nn.Conv1d, nn.Conv2d)) and m is not head
    }


def _lowest(scores: torch.Tensor, k: int) -> torch.Tensor:
    keep = torch.ones(scores.numel(), dtype=torch.bool)
    keep[torch.argsort(scores.flatten())[:k]] = False
    return keep


def topk_masks(scores: dict[str, torch.Tensor], ratios: dict[str, float], scope: str) -> dict[str, torch.Tensor]:
    """Masks keeping the highest scores: per layer (`ratios[name]` each) or globally.

    In "global" scope one threshold over all layers removes the size-weighted mean of `ratios`.
    """
    if scope == "layer":
        return {n: _lowest(s, int(round(ratios[n] * s.numel()))).view_as(s) for n, s in scores.items()}
    total = sum(s.numel() for s in scores.values())
    k = int(round(sum(ratios[n] * s.numel() for n, s in scores.items())))
    keep = _lowest(torch.cat([s.flatten() for s in scores.values()]), k)
    out, offset = {}, 0
    for name, s in scores.items():
        out[name] = keep[offset : offset + s.numel()].view_as(s).clone()
        offset += s.numel()
    assert offset == total
    return out


class UnstructuredPruning(PruningMethod):
    """Masks over dense weights from per-weight scores, globally or per layer."""

    options = frozenset({"target", "scope"})
    required = frozenset({"target"})

    @property
    def speedup(self) -> str:
        return "none through dense kernels: zeros are multiplied like any other weight"

    def __init__(self, ctx: PruneContext):
        super().__init__(ctx)
        self._masks: dict[str, torch.Tensor] = {}

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        """Per prunable weight, its importance (higher = keep)."""
        raise NotImplementedError

    def layer_ratios(self, names: list[str], fraction: float) -> dict[str, float]:
        """Each layer's ratio at this point of the schedule."""
        alloc = self.ctx.layer_allocation
        return {n: (alloc.get(n, 0.0) if alloc is not None else self.ctx.target_ratio) * fraction for n in names}

    @torch.no_grad()
    def apply_(self, model: nn.Module, fraction: float) -> None:
        scores = self.scores(model)
        for name, mask in self._masks.items():
            # Pruned weights stay pruned: their scores no longer move.
            scores[name] = torch.where(mask, scores[name], torch.full_like(scores[name], -torch.inf))
        scope = "layer" if self.ctx.layer_allocation is not None else self.ctx.scope
        self._masks = topk_masks(scores, self.layer_ratios(list(scores), fraction), scope)
        self.after_step(model)

    def after_step(self, model: nn.Module) -> None:
        apply_masks_(model, self._masks)

    def masks(self) -> dict[str, torch.Tensor]:
        return dict(self._masks)


@METHODS.register("magnitude", "unstructured magnitude, global or per layer: zeros in dense layers (no CPU speed-up)")
class MagnitudePruning(UnstructuredPruning):
    """Unstructured magnitude pruning (|w| for l1, w^2 for l2: the same ranking per weight)."""

    options = frozenset({"target", "scope", "importance"})
    required = frozenset({"target", "importance"})
    importances = frozenset({"l1", "l2"})

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        power = 2 if self.ctx.criterion.name == "l2" else 1
        return {n: w.detach().abs().pow(power) for n, w in prunable_weights(model).items()}


@METHODS.register("movement", "movement pruning (Sanh et al. 2020): scores -W*dL/dW accumulated while fine-tuning")
class MovementPruning(UnstructuredPruning):
    """Hard movement pruning: keeps the weights whose accumulated -W * dL/dW is largest.

    Scores accumulate over every fine-tuning batch (a warm-up pass comes before the first step),
    so they measure how training moves each weight away from zero, not its magnitude.
    """

    needs_warmup = True

    def __init__(self, ctx: PruneContext):
        super().__init__(ctx)
        self._scores: dict[str, torch.Tensor] = {}

    @torch.no_grad()
    def after_backward(self, model: nn.Module) -> None:
        for name, w in prunable_weights(model).items():
            if w.grad is None:
                continue
            delta = -(w.detach() * w.grad)
            self._scores[name] = self._scores.get(name, torch.zeros_like(w)) + delta

    def scores(self, model: nn.Module) -> dict[str, torch.Tensor]:
        weights = prunable_weights(model)
        if not self._scores:
            raise RuntimeError("movement pruning has no scores yet: fine-tune (warm-up) before pruning")
        return {n: self._scores.get(n, torch.zeros_like(w)).clone() for n, w in weights.items()}


def semi_structured_available() -> str | None:
    """Why 2:4 kernels cannot run here, or None when a CUDA device of capability >= 8.0 can."""
    if not torch.cuda.is_available():
        return "no CUDA device"
    major, _ = torch.cuda.get_device_capability()
    if major < 8:
        return f"CUDA compute capability {major}.x < 8.0"
    return None


def semi_structured_mask(w: torch.Tensor) -> torch.Tensor:
    """In every group of 4 consecutive input weights, True for the 2 largest |w|."""
    out_f, in_f = w.shape
    groups = w.detach().abs().reshape(out_f, in_f // 4, 4)
    top = groups.topk(2, dim=-1).indices
    mask = torch.zeros_like(groups, dtype=torch.bool).scatter_(-1, top, True)
    return mask.reshape(out_f, in_f)


@METHODS.register("semi_structured", "2:4 sparsity on Linear layers (2 of every 4 inputs kept; CUDA >= 8.0 speed-up)")
class SemiStructuredPruning(UnstructuredPruning):
    """2:4 semi-structured sparsity on every eligible Linear (not the classifier).

    The pattern is fixed at 50%: `target` does not apply. With a sensitivity allocation,
    only layers allocated at least 0.5 get the pattern. On CUDA (capability >= 8.0)
    `to_semi_structured_` converts them for cuSPARSELt kernels; on CPU the masked weights stay
    dense and give no speed-up.
    """

    options = frozenset()
    required = frozenset()

    @property
    def speedup(self) -> str:
        reason = semi_structured_available()
        if reason:
            return f"not available on CPU ({reason}): masked dense weights"
        # 2:4 matmuls pay a fixed cost per call that encoder-sized Linears do not recover
        # (docs/explanation/structured-pruning.md#two-four); the served ONNX weights are dense anyway.
        return (
            "none claimed: cuSPARSELt 2:4 kernels exist on this device, but the exported model keeps dense "
            "weights, and torch.sparse 2:4 ran slower than dense fp16 at encoder sizes "
            "(docs/explanation/structured-pruning.md)"
        )

    def eligible(self, model: nn.Module) -> dict[str, nn.Parameter]:
        """Linear weights (not the classifier) whose input width is a multiple of 4."""
        head = classifier_of(model)
        alloc = self.ctx.layer_allocation
        out = {}
        for n, m in model.named_modules():
            name = f"{n}.weight"
            if not isinstance(m, nn.Linear) or m is head or m.in_features % 4:
                continue
            if alloc is not None and alloc.get(name, 0.0) < 0.5:
                continue
            out[name] = m.weight
        return out

    @torch.no_grad()
    def apply_(self, model: nn.Module, fraction: float) -> None:
        self._masks = {n: semi_structured_mask(w) for n, w in self.eligible(model).items()}
        self.after_step(model)


@torch.no_grad()
def to_semi_structured_(model: nn.Module, masks: dict[str, torch.Tensor]) -> list[str]:
    """Converts the 2:4-masked Linear weights to `torch.sparse` semi-structured tensors (CUDA).

    Returns:
        The converted parameter names. The model must already be on a CUDA device in fp16/bf16.
    """
    from torch.sparse import to_sparse_semi_structured

    modules = dict(model.named_modules())
    done = []
    for name in masks:
        module = modules[name.rsplit(".", 1)[0]]
        module.weight = nn.Parameter(to_sparse_semi_structured(module.weight.detach()), requires_grad=False)
        done.append(name)
    return done
