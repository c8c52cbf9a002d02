"""The one training loop: AdamW, cosine LR, early stopping on validation, optional distillation."""

from __future__ import annotations

import copy
import logging
import math
import os
import random
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from pruneops.augment import augment_images
from pruneops.data.splits import Split
from pruneops.errors import PruneOpsError
from pruneops.inputs import as_feed, as_tensors, count_rows, length_order, rows, run_model, trim_padding

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class FitSettings:
    """Hyper-parameters of one call of `fit_`."""

    epochs: int
    batch_size: int = 64
    lr: float = 1e-3
    weight_decay: float = 1e-4
    patience: int = 5
    seed: int = 0
    warmup_epochs: float = 0.0  # linear LR warm-up before the cosine decay
    freeze_epochs: int = 0  # epochs during which only `frozen_except` trains
    crop_padding: int = 0  # training augmentation (`pruneops.augment`); 0 and False: none
    hflip: bool = False

    @property
    def augmented(self) -> bool:
        """Whether training batches change from epoch to epoch."""
        return bool(self.crop_padding or self.hflip)

    @property
    def earliest_stop(self) -> float:
        """The epoch before which early stopping waits: where the cosine LR is down to half its peak.

        While the LR is high, validation accuracy swings from epoch to epoch and most of what the
        run will gain comes as the LR falls, so `patience` stale epochs there say little. Counted
        from the start, they stopped the default run's dense CNN at epoch 8 of 30 with the LR at
        0.83 of its peak (96.4 % test, below its own pruned student), and a 15-epoch fine-tuning of
        the wide MNIST CNN at epoch 5 (97.97 % validation, where a thinner plan reached 98.98 %
        after all 15; docs/wide-latency-val12k).
        """
        return self.warmup_epochs + (self.epochs - self.warmup_epochs) / 2


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
    # errors (a pruned ViT-style model with an under-trained 85.7 % teacher: 88.9 % test
    # distilled, 91.4 % on labels alone; docs/families-taught). None: every epoch.
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


def onnx_forward(model: nn.Module, input_shape: Sequence[int], example, threads: int, atol: float = 1e-3):
    """`model`'s forward pass on ONNX Runtime: a function of a batch that returns torch logits.

    A frozen teacher runs once per batch of every epoch when the inputs are augmented; ONNX
    Runtime ran MobileNetV2's at 64x64 in 45 ms per batch of 128 on 2 cores against 142 ms in
    PyTorch (channels-last, no grad), which took a distilled, augmented fine-tuning epoch of a
    pruned student (1/9 of the teacher's parameters) from ~107 to ~96 s: the rest is the student.

    Args:
        model: The model; exported as it is (eval mode), never trained afterwards.
        input_shape: One sample's shape (as `export_onnx_file` takes it).
        example: A batch (tensors) the export is checked on.
        threads: ONNX Runtime's intra-op threads.
        atol: Largest |PyTorch - ONNX Runtime| logit difference accepted on `example`.

    Raises:
        PruneOpsError: The export's logits differ from PyTorch's by more than `atol`.
    """
    import tempfile

    from pruneops.onnx_utils import export_onnx_file, make_session

    model.eval()
    with tempfile.TemporaryDirectory(prefix="pruneops-teacher-") as tmp:
        path = Path(tmp) / "teacher.onnx"
        export_onnx_file(model, list(input_shape), path, 18)
        session = make_session(path.read_bytes(), threads)

    def forward(xb) -> torch.Tensor:
        feed = {k: v.numpy() for k, v in xb.items()} if isinstance(xb, Mapping) else xb.numpy()
        return torch.from_numpy(session.run(None, as_feed(feed))[0])

    with torch.no_grad():
        diff = float((forward(example) - run_model(model, example)).abs().max())
    if diff > atol:
        raise PruneOpsError(
            f"the teacher on ONNX Runtime differs from PyTorch by {diff:.2e} > {atol:g}: "
            "set finetune.teacher_runtime: torch"
        )
    return forward


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


@dataclass
class FitResult:
    """Per-epoch history and the epoch whose weights were kept."""

    history: list[dict] = field(default_factory=list)
    best_epoch: int = 0
    best_val_accuracy: float = 0.0


@contextmanager
def torchrun_group() -> Iterator[tuple[int, int]]:
    """Joins the process group (gloo) when launched by torchrun; yields (rank, world size)."""
    import torch.distributed as dist

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1 or dist.is_initialized():
        yield distributed_rank_world()
        return
    dist.init_process_group("gloo")
    try:
        yield dist.get_rank(), world
    finally:
        dist.destroy_process_group()


def distributed_rank_world() -> tuple[int, int]:
    """(rank, world size) of an initialised torch.distributed group, else (0, 1)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


@contextmanager
def channels_last_(*models: nn.Module | None) -> Iterator[bool]:
    """Stores the 4-D weights of convolutional `models` channels-last inside the block.

    PyTorch's CPU kernels train depthwise and pointwise convolutions 1.2-3x faster on
    channels-last tensors (MobileNetV2 at 64x64: 157 -> 481 images/s on 2 cores), and a conv
    with a channels-last weight makes its output channels-last, so the inputs need no change.
    The weights are stored contiguously again on exit, as checkpoints, pruning and export expect.
    Yields whether any model was converted: models without a Conv2d are left alone, and so are
    models already converted by an enclosing block (which restores them), and models with a
    convolution that PyTorch's channels-last kernels get wrong (`_channels_last_unsafe`).
    """
    convolutional = [m for m in models if m is not None and _stored_contiguously(m) and not _channels_last_unsafe(m)]
    for m in convolutional:
        m.to(memory_format=torch.channels_last)
    try:
        yield bool(convolutional)
    finally:
        for m in convolutional:
            m.to(memory_format=torch.contiguous_format)


def _channels_last_unsafe(model: nn.Module) -> bool:
    """Whether `model` has a strided 1x1 Conv2d over fewer than 8 input channels.

    Its channels-last backward pass in torch 2.13's CPU build corrupts the heap on a 2-core AMD
    EPYC (Zen 3, AVX2): glibc aborts ("corrupted size vs. prev_size") with 1 thread, and with 2 the
    weight gradients differ run to run (two seeded fits of a ResNet with a 4 -> 8 projection
    shortcut ended 0.07 apart). Measured for 2-6 input channels; 7, 8, 16 and 64 and a 3x3 stride-2
    conv over 4 were exact. Pruning makes such widths, so those models train in NCHW.
    """
    return any(
        isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and max(m.stride) > 1 and m.in_channels < 8
        for m in model.modules()
    )


def _stored_contiguously(model: nn.Module) -> bool:
    """Whether `model` has a Conv2d whose weight is stored in the standard (NCHW) layout."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    return any(w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last) for w in weights)


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@torch.no_grad()
def predict_logits(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> torch.Tensor:
    """Logits of `model` (eval mode) over `x`, in the order of `x`.

    Texts are run shortest first, so that each batch is cut to its own longest text rather than
    to the data's padded length (about 0.6 of the work on review snippets).
    """
    model.eval()
    xs = as_tensors(x)
    order = length_order(xs)
    if order is not None:
        xs = rows(xs, order)
    chunks = (trim_padding(rows(xs, slice(i, i + batch_size))) for i in range(0, count_rows(xs), batch_size))
    with channels_last_(model):
        logits = torch.cat([run_model(model, xb) for xb in chunks])
    if order is None:
        return logits
    restored = torch.empty_like(logits)
    restored[order] = logits
    return restored


def clone_with_grads(model: nn.Module) -> nn.Module:
    """A deep copy of `model` that keeps each parameter's `.grad` (`copy.deepcopy` drops them)."""
    twin = copy.deepcopy(model)
    for source, copied in zip(model.parameters(), twin.parameters(), strict=True):
        if source.grad is not None:
            copied.grad = source.grad.detach().clone()
    return twin


def calibration_subset(x: np.ndarray, n: int, seed: int) -> np.ndarray | None:
    """`n` rows of `x` drawn without replacement by `seed` (in their original order); None for 0."""
    if n <= 0:
        return None
    picks = np.random.default_rng(seed).permutation(count_rows(x))[:n]
    return rows(x, np.sort(picks))


@torch.no_grad()
def recalibrate_batchnorm_(model: nn.Module, x: np.ndarray, batch_size: int = 256) -> bool:
    """Re-estimates every BatchNorm's running statistics on `x` (forward passes, no training).

    The statistics become the plain average over `x`, as in adaptive-BN evaluation of pruned
    candidates; the model is left in eval mode.

    Returns:
        Whether the model had BatchNorm layers to recalibrate.
    """
    norms = [m for m in model.modules() if isinstance(m, nn.modules.batchnorm._BatchNorm)]
    if not norms or count_rows(x) == 0:
        return False
    saved = [m.momentum for m in norms]
    for m in norms:
        m.reset_running_stats()
        m.momentum = None  # cumulative average over the batches below
    model.train()
    xs = as_tensors(x)
    with channels_last_(model):
        for i in range(0, count_rows(xs), batch_size):
            run_model(model, trim_padding(rows(xs, slice(i, i + batch_size))))
    for m, momentum in zip(norms, saved, strict=True):
        m.momentum = momentum
    model.eval()
    return True


def evaluate(model: nn.Module, split: Split, batch_size: int = 512) -> tuple[float, float]:
    """Accuracy and mean cross-entropy of `model` on `split`."""
    logits = predict_logits(model, split.x, batch_size)
    y = torch.from_numpy(split.y)
    return float((logits.argmax(1) == y).float().mean()), float(F.cross_entropy(logits, y))


def _loss(logits: torch.Tensor, y: torch.Tensor, idx: torch.Tensor, xb, kd: Distillation | None) -> torch.Tensor:
    ce = F.cross_entropy(logits, y)
    if kd is None or kd.weight == 0:
        return ce
    teacher_logits = kd.teacher_logits(idx, xb)
    t = kd.temperature
    kl = F.kl_div(
        F.log_softmax(logits / t, 1), F.log_softmax(teacher_logits / t, 1), log_target=True, reduction="batchmean"
    )
    loss = kd.weight * t * t * kl + (1 - kd.weight) * ce
    if kd.taps is not None:
        loss = loss + kd.hidden_weight * kd.taps.mse()
    return loss


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


def fit_(
    model: nn.Module,
    train: Split,
    val: Split,
    settings: FitSettings,
    *,
    distillation: Distillation | None = None,
    after_backward: Callable[[nn.Module], None] | None = None,
    after_step: Callable[[nn.Module], None] | None = None,
    desc: str = "train",
    frozen_except: nn.Module | None = None,
) -> FitResult:
    """Trains `model` in place and leaves it with the weights of its best validation epoch.

    Args:
        model: The model to train.
        train: Training split.
        val: Validation split for early stopping.
        settings: Epochs, batch size, LR, weight decay, patience, seed.
        distillation: Teacher and loss weighting, for recovery fine-tuning.
        after_backward: Called after each backward pass (e.g. to accumulate movement scores).
        after_step: Called after each optimizer step (e.g. to re-apply pruning masks).
        desc: Label of the progress bar (shown on terminals only).
        frozen_except: The module that alone trains for the first `settings.freeze_epochs`
            epochs (a new classifier over pretrained features); the rest then joins.

    Returns:
        History per epoch and the best epoch (by validation accuracy, then loss).
    """
    seed_everything(settings.seed)
    distillation = with_teacher_outputs(distillation, train, settings.augmented)
    if distillation is not None and distillation.hidden_weight > 0:
        distillation = replace(distillation, taps=BlockTaps(model, distillation.teacher))
    teacher = distillation.teacher if distillation is not None else None
    try:
        with channels_last_(model, teacher):
            hooks = (after_backward, after_step)
            return _fit_epochs(model, train, val, settings, distillation, hooks, desc, frozen_except)
    finally:
        if distillation is not None and distillation.taps is not None:
            distillation.taps.close()


def _fit_epochs(model, train: Split, val: Split, settings: FitSettings, distillation, hooks, desc, frozen_except):
    """`fit_`'s epochs, once its teacher is prepared."""
    xs, ys = as_tensors(train.x), torch.from_numpy(train.y)
    rank, world = distributed_rank_world()
    # Under DDP each rank takes every world-th sample of the same shuffled order, equally many
    # per rank (unequal batch counts would hang the gradient all-reduce), with the global batch
    # size unchanged; every rank validates on the full split, so early stopping agrees.
    per_rank = len(ys) // world
    batch_size = max(1, settings.batch_size // world)
    forward = model
    if world > 1:
        from torch.nn.parallel import DistributedDataParallel

        forward = DistributedDataParallel(model)
    steps_per_epoch = max(1, -(-per_rank // batch_size))
    params = [p for p in model.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=settings.lr, weight_decay=settings.weight_decay)
    sched = _schedule(opt, settings, steps_per_epoch)
    trainable = {id(p) for p in frozen_except.parameters()} if frozen_except is not None else None
    gen = torch.Generator().manual_seed(settings.seed)
    aug_gen = torch.Generator().manual_seed(settings.seed + 1)  # augmenting leaves the batch order as it was

    result = FitResult()
    best_key = (-1.0, 0.0)
    best_state = copy.deepcopy(model.state_dict())
    stale = 0
    val_acc = evaluate(model, val)[0] if distillation is not None and distillation.until_accuracy is not None else 0.0
    bar = tqdm(range(1, settings.epochs + 1), desc=desc, unit="epoch", disable=None, leave=False)
    for epoch in bar:
        started = time.perf_counter()
        model.train()
        if trainable is not None:
            # Frozen parameters get no gradient, so AdamW leaves them (and their decay) alone.
            for p in params:
                p.requires_grad_(epoch > settings.freeze_epochs or id(p) in trainable)
        order = torch.randperm(len(ys), generator=gen)[: per_rank * world][rank::world]
        picks = (order[i : i + batch_size] for i in range(0, per_rank, batch_size))
        batches = ((idx, trim_padding(rows(xs, idx))) for idx in picks)
        if settings.augmented:
            crop, flip = settings.crop_padding, settings.hflip
            batches = ((idx, augment_images(xb, crop, flip, aug_gen)) for idx, xb in batches)
        teaching = epoch_distillation(distillation, val_acc, epoch, desc)
        train_loss = _train_epoch(model, forward, ys, batches, (opt, sched), teaching, hooks)
        val_acc, val_loss = evaluate(model, val)
        result.history.append(
            {
                "epoch": epoch,
                "train_loss": train_loss,
                "val_loss": val_loss,
                "val_accuracy": val_acc,
                "lr": opt.param_groups[0]["lr"],
                "distilled": teaching is not None and teaching.teaches,
            }
        )
        bar.set_postfix(val_acc=f"{val_acc:.4f}")
        # The bar shows on terminals only; a log line per epoch is what a long run under DVC or a
        # flow shows of its progress.
        logger.info(
            "%s epoch %d/%d: train loss %.4f, val loss %.4f, val acc %.4f (%.0f s)",
            desc,
            epoch,
            settings.epochs,
            train_loss,
            val_loss,
            val_acc,
            time.perf_counter() - started,
        )
        if (val_acc, -val_loss) > best_key:
            best_key, stale = (val_acc, -val_loss), 0
            best_state = copy.deepcopy(model.state_dict())
            result.best_epoch, result.best_val_accuracy = epoch, val_acc
        else:
            stale += 1
            if stale >= settings.patience and epoch >= settings.earliest_stop:
                break
    bar.close()
    for p in params:
        p.requires_grad_(True)
    model.load_state_dict(best_state)
    return result


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


def _train_epoch(model, forward, ys, batches, optimizer, distillation, hooks) -> float:
    """One pass over `batches` ((indices into `ys`, inputs) pairs); the mean training loss."""
    (opt, sched), (after_backward, after_step) = optimizer, hooks
    total, seen = 0.0, 0
    for idx, xb in batches:
        yb = ys[idx]
        loss = _loss(run_model(forward, xb), yb, idx, xb, distillation)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        if after_backward is not None:
            after_backward(model)
        opt.step()
        sched.step()
        if after_step is not None:
            after_step(model)
        total += loss.detach().item() * len(idx)
        seen += len(idx)
    return total / seen


def _schedule(opt: torch.optim.Optimizer, settings: FitSettings, steps_per_epoch: int):
    """Cosine decay over the whole run, after a linear warm-up when `warmup_epochs` > 0."""
    total = max(1, settings.epochs * steps_per_epoch)
    warm = min(total - 1, round(settings.warmup_epochs * steps_per_epoch))
    if warm <= 0:
        return torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=total)

    def factor(step: int) -> float:
        if step < warm:
            return (step + 1) / warm
        return 0.5 * (1.0 + math.cos(math.pi * (step - warm) / (total - warm)))

    return torch.optim.lr_scheduler.LambdaLR(opt, factor)
