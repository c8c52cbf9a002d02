"""Knowledge distillation for fine-tuning.

The teacher's logits and block outputs for every training sample, computed once and cached within a memory budget.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F
from torch import nn

from pruneops.core.errors import PruneOpsError
from pruneops.core.inputs import as_tensors, count_rows, rows, run_model
from pruneops.data.splits import Split
from pruneops.models.forward import channels_last_, predict_logits

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Distillation:
    """Knowledge distillation from a teacher: loss = w * T^2 * KL + (1 - w) * CE."""

    teacher: nn.Module
    temperature: float = 4.0
    weight: float = 0.5
    # The teacher's logits per training sample, when the inputs are the same every epoch (no
    # augmentation): the teacher then runs once per `fit_`, not once per batch of every epoch.
    logits: torch.Tensor | None = None
    # Added to the loss: this times the mean squared error between the outputs of the blocks
    # (encoder layers) that student and teacher share (`BlockTaps`): layer-wise distillation,
    # as in TinyBERT and CoFi. The teacher's block outputs per training sample are cached beside
    # its logits (`blocks`) when they fit in `TEACHER_CACHE_BYTES`; else it runs on every batch.
    hidden_weight: float = 0.0
    taps: BlockTaps | None = None
    blocks: CachedBlocks | None = None
    # Runs the teacher's forward pass in its place (`onnx_forward`): on ONNX Runtime the frozen
    # teacher of an augmented fine-tuning is ~3x cheaper than in PyTorch on a CPU.
    run_teacher: Callable[[object], torch.Tensor] | None = None
    # Distil only in epochs that begin with the student's validation accuracy below this (the
    # teacher's): a teacher the student already matches pulls it back towards the teacher's
    # errors (docs/explanation/training.md#while-below-teacher). None: every epoch.
    until_accuracy: float | None = None

    @property
    def teaches(self) -> bool:
        """Whether the teacher adds anything to the loss (a logit or a block-output weight)."""
        return self.weight > 0 or self.hidden_weight > 0

    def teacher_logits(self, idx: torch.Tensor, xb) -> torch.Tensor:
        """The teacher's logits on batch `xb` (training samples `idx`); its block outputs go to `taps`."""
        if self.logits is not None:
            if self.taps is not None and self.blocks is not None:
                self.taps.outputs["teacher"].update(self.blocks.batch(idx, xb))
            return self.logits[idx]
        if self.run_teacher is not None:
            return self.run_teacher(xb)
        with torch.no_grad():
            return run_model(self.teacher, xb)


# The teacher's block outputs kept for a whole fit at most (fp32). MiniLM's six layers over 9,180
# reviews padded to 48 tokens take 3.8 GiB; caching them spares the teacher's forward pass on
# every batch of every epoch, the larger half of a fine-tuning step of a 4x-pruned student.
TEACHER_CACHE_BYTES = 4 * 2**30


@dataclass(frozen=True)
class CachedBlocks:
    """The teacher's repeated-block outputs per training sample, computed at the split's padded length."""

    outputs: dict[str, torch.Tensor]
    # Per block, the dim that follows the text's length (None: none does). Training cuts a batch
    # of texts to its longest (`trim_padding`); the padding it drops is masked out of attention,
    # so what the teacher gives the positions kept does not depend on it.
    seq_dims: dict[str, int | None]

    def batch(self, idx: torch.Tensor, xb) -> dict[str, torch.Tensor]:
        """The outputs of samples `idx`, cut to the length of batch `xb`."""
        length = xb["attention_mask"].shape[-1] if isinstance(xb, Mapping) and "attention_mask" in xb else None
        out = {}
        for name, values in self.outputs.items():
            picked, dim = values[idx], self.seq_dims[name]
            out[name] = picked if dim is None or length is None else picked.narrow(dim, 0, length)
        return out


def repeated_blocks(student: nn.Module, teacher: nn.Module) -> list[str]:
    """Names of the blocks both models hold: the children of every ModuleList or Sequential of one module class.

    Those are a transformer's layers (`encoder.layer.3`, timm's `blocks.3`), whose outputs keep
    the hidden width when heads and FFN neurons are removed, so a pruned layer can be matched to
    its original.
    """
    in_teacher = dict(teacher.named_modules())
    names = []
    for name, module in student.named_modules():
        children = list(module.named_children())
        if not isinstance(module, (nn.ModuleList, nn.Sequential)) or len(children) < 2:
            continue
        if len({type(child) for _, child in children}) == 1:
            prefix = f"{name}." if name else ""
            names += [prefix + child for child, _ in children if prefix + child in in_teacher]
    return names


def block_output(output) -> torch.Tensor:
    """What a block hands the next one (a transformer layer returns a tuple: its hidden states first)."""
    return output[0] if isinstance(output, (tuple, list)) else output


class BlockTaps:
    """Forward hooks keeping the outputs of the same-named blocks of a student and its teacher.

    Raises:
        PruneOpsError: The models share no repeated blocks.
    """

    def __init__(self, student: nn.Module, teacher: nn.Module):
        self.names = repeated_blocks(student, teacher)
        if not self.names:
            raise PruneOpsError(
                "hidden_distill_weight: the model has no repeated blocks (a ModuleList of layers) to match "
                "with the baseline's; set it to 0"
            )
        self.outputs: dict[str, dict[str, torch.Tensor]] = {"student": {}, "teacher": {}}
        modules = {"student": dict(student.named_modules()), "teacher": dict(teacher.named_modules())}
        self.handles = [
            modules[side][name].register_forward_hook(_recording(self.outputs[side], name))
            for side in modules
            for name in self.names
        ]

    def mse(self) -> torch.Tensor:
        """Mean over the blocks of equal output shape of the student's squared error to the teacher (last batch).

        Raises:
            PruneOpsError: No block kept its output shape (the hidden width was pruned).
        """
        student, teacher = self.outputs["student"], self.outputs["teacher"]
        pairs = [(student[n], teacher[n]) for n in self.names if n in student and n in teacher]
        pairs = [(a, b.detach()) for a, b in pairs if a.shape == b.shape]
        student.clear()
        teacher.clear()
        if not pairs:
            raise PruneOpsError(
                "hidden_distill_weight: no block of the pruned model has its baseline's output shape "
                "(the hidden width was pruned); set it to 0"
            )
        return torch.stack([F.mse_loss(a, b) for a, b in pairs]).mean()

    def close(self) -> None:
        """Removes the hooks."""
        for handle in self.handles:
            handle.remove()


def epoch_distillation(
    distillation: Distillation | None, student_val_accuracy: float, epoch: int, desc: str
) -> Distillation | None:
    """The distillation an epoch trains with: none once the student matches the teacher.

    Args:
        distillation: The fit's distillation (None: fitting on labels alone).
        student_val_accuracy: The student's validation accuracy as the epoch begins.
        epoch: The epoch (1-based), for the log line.
        desc: The fit's label, for the log line.

    Returns:
        `distillation`, or None when its `until_accuracy` is set and reached.
    """
    if distillation is None or distillation.until_accuracy is None:
        return distillation
    if student_val_accuracy < distillation.until_accuracy:
        return distillation
    logger.info(
        "%s epoch %d: val acc %.4f >= the teacher's %.4f: this epoch fits on labels alone",
        desc,
        epoch,
        student_val_accuracy,
        distillation.until_accuracy,
    )
    return None


def with_teacher_outputs(distillation: Distillation | None, train: Split, augmented: bool) -> Distillation | None:
    """`distillation` with what its teacher gives each sample of `train` computed once.

    Its logits and, for layer-wise distillation, its repeated blocks' outputs (see
    `cache_blocks`), unless the inputs change per epoch (augmentation) or they are cached already:
    a caller that fits several times with one teacher (the prune steps) calls this once.
    """
    if distillation is None:
        return None
    distillation.teacher.eval()
    if distillation.weight == 0 or augmented or distillation.logits is not None:
        return distillation
    if distillation.hidden_weight > 0:
        cached = cache_blocks(distillation.teacher, train.x)
        return distillation if cached is None else replace(distillation, logits=cached[0], blocks=cached[1])
    # Shortest texts first in one pass (`predict_logits`): on MiniLM this costs less than the
    # teacher's share of one epoch of padded batches.
    return replace(distillation, logits=predict_logits(distillation.teacher, train.x, 256))


@torch.no_grad()
def cache_blocks(
    teacher: nn.Module, x, batch_size: int = 128, budget: int | None = None
) -> tuple[torch.Tensor, CachedBlocks] | None:
    """The teacher's logits and repeated-block outputs on every sample of `x`, at its padded length.

    None (logged) where the outputs would take more than `budget` bytes (`TEACHER_CACHE_BYTES`):
    the teacher then runs on every batch instead, to the same effect.
    """
    budget = TEACHER_CACHE_BYTES if budget is None else budget
    names = repeated_blocks(teacher, teacher)
    if not names:
        return None  # nothing to distil layer by layer (`BlockTaps` says so)
    modules = dict(teacher.named_modules())
    latest: dict[str, torch.Tensor] = {}
    hooks = [modules[n].register_forward_hook(_recording(latest, n)) for n in names]
    try:
        xs = as_tensors(x)
        n = count_rows(xs)
        shapes, seq_dims = _sample_shapes(teacher, xs, latest)
        per_sample = sum(math.prod(shape) for shape in shapes.values())
        if per_sample * n * 4 > budget:
            logger.info(
                "layer-wise distillation: the teacher's block outputs would take %.1f GiB (over %.1f): "
                "the teacher runs on every batch",
                per_sample * n * 4 / 2**30,
                budget / 2**30,
            )
            return None
        outputs = {name: torch.empty((n, *shape), dtype=torch.float32) for name, shape in shapes.items()}
        logits = []
        with channels_last_(teacher):
            for i in range(0, n, batch_size):
                logits.append(run_model(teacher, rows(xs, slice(i, i + batch_size))))
                for name, values in latest.items():
                    outputs[name][i : i + batch_size] = values
    finally:
        for hook in hooks:
            hook.remove()
    return torch.cat(logits), CachedBlocks(outputs, seq_dims)


def _recording(latest: dict[str, torch.Tensor], name: str):
    """A forward hook keeping block `name`'s output in `latest` (the cache runs without grad; taps need it)."""

    def hook(_module: nn.Module, _inputs: tuple, output) -> None:
        latest[name] = block_output(output)

    return hook


def _sample_shapes(teacher: nn.Module, xs, latest: dict[str, torch.Tensor]):
    """Per block, one sample's output shape at the padded length and the dim that shortens with the text.

    From the first sample, run as it is and one token shorter (None: no dim follows the length).
    """
    first = rows(xs, slice(0, 1))
    run_model(teacher, first)
    full = {name: tuple(t.shape[1:]) for name, t in latest.items()}
    if not isinstance(first, Mapping) or "attention_mask" not in first or first["attention_mask"].shape[-1] < 2:
        return full, dict.fromkeys(full)
    length = first["attention_mask"].shape[-1]
    run_model(teacher, {k: v[..., : length - 1] if v.shape[-1] == length else v for k, v in first.items()})
    dims = {}
    for name, shape in full.items():
        moved = [d for d, (a, b) in enumerate(zip(shape, latest[name].shape[1:], strict=True), 1) if a != b]
        dims[name] = moved[0] if moved else None
    return full, dims
