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

from pruneops.config import FitParams
from pruneops.core.errors import PruneOpsError
from pruneops.core.inputs import as_feed, as_tensors, count_rows, rows, run_model, trim_padding
from pruneops.data.augment import augment_images
from pruneops.data.splits import Split
from pruneops.models.forward import channels_last_, predict_logits
from pruneops.training.distillation import BlockTaps, Distillation, epoch_distillation, with_teacher_outputs

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
    crop_padding: int = 0  # training augmentation (`pruneops.data.augment`); 0 and False: none
    hflip: bool = False

    @property
    def augmented(self) -> bool:
        """Whether training batches change from epoch to epoch."""
        return bool(self.crop_padding or self.hflip)

    @property
    def earliest_stop(self) -> float:
        """The epoch before which early stopping waits: where the cosine LR is down to half its peak.

        While the LR is high, validation accuracy swings from epoch to epoch and most of what the
        run will gain comes as the LR falls, so `patience` stale epochs there say little
        (docs/explanation/training.md#earliest-stop).
        """
        return self.warmup_epochs + (self.epochs - self.warmup_epochs) / 2


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

    from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session

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


def seed_everything(seed: int) -> None:
    """Seeds Python, NumPy and torch."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def parameter_grads(model: nn.Module) -> dict[str, torch.Tensor]:
    """Each parameter's `.grad` by name (`copy.deepcopy` and pickling a model drop them)."""
    return {n: p.grad.detach() for n, p in model.named_parameters() if p.grad is not None}


def clone_with_grads(model: nn.Module, grads: dict[str, torch.Tensor] | None = None) -> nn.Module:
    """A deep copy of `model` whose parameters carry `model`'s gradients, or `grads` by name.

    `grads` (from `parameter_grads`) is for a model that travelled without them, pickled to
    another process.
    """
    grads = parameter_grads(model) if grads is None else grads
    twin = copy.deepcopy(model)
    for name, param in twin.named_parameters():
        if name in grads:
            param.grad = grads[name].detach().clone()
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


def fit_settings(config: FitParams) -> FitSettings:
    """The training-loop settings of a `FitParams` section (with the section's resolved defaults)."""
    return FitSettings(
        config.epochs,
        config.batch_size,
        config.resolved_lr,
        config.weight_decay,
        config.patience,
        config.seed,
        config.resolved_warmup_epochs,
        config.frozen_epochs,
        config.augment.crop_padding if config.augment else 0,
        config.augment.hflip if config.augment else False,
    )
