"""Recovery of a cut causal LM by distillation from the unpruned model, within a token budget.

The student is trained on training blocks to match the teacher's next-token distribution (KL
divergence of softened logits, scaled by T²), weighted by `distill_weight` against the plain
next-token loss on the training text (1: distillation only; 0: the text alone). Training stops
when `max_tokens` tokens have been consumed (whole batches; the last one is cut to fit), so the
report says exactly what recovery cost: tokens and wall time. The learning rate warms up
linearly over the first tenth and decays with a cosine to zero at the budget. With
`compute_dtype` bf16 the forward passes of student and teacher run under autocast (matrix
products in bfloat16); weights, gradients and the optimiser stay fp32. `device` says where
recovery trains: the CPU, or a CUDA device, where student and teacher move for the run and
come back to where they were after it. A CUDA device that torch does not see is refused.

With `lora_rank`, only low-rank adapters of the decoder layers' projections train (LoRA: each
weight W gets `alpha / rank x B A`, B zero at the start); every other weight stays frozen, so
AdamW keeps state for the adapters alone. After training the adapters are merged into the
weights: the result has the cut model's modules and shapes, and exports as it would have.

With a `Checkpoint`, recovery saves its progress (the trained weights, the optimiser, the
schedule, the place in the data) every `every_s` seconds and at its end, in a file named by its
inputs (settings, blocks, student and teacher weights: a SHA-256 of them all), and a run of the
same inputs resumes from there: a recovery of hours that is stopped loses at most `every_s` of
its training. The resumed run takes the steps the uninterrupted one would have taken, in the
same order.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.core.io import replaced_whole
from pruneops.core.progress import Progress
from pruneops.timing.machine import cpu_flags

log = logging.getLogger(__name__)

ComputeDtype = Literal["fp32", "bf16"]
NATIVE_BF16_FLAGS = ("avx512_bf16", "amx_bf16", "bf16")  # x86 AVX-512 / AMX, Arm (cpuinfo `Features`)


@dataclass(frozen=True)
class RecoverySettings:
    """How recovery trains."""

    max_tokens: int
    batch_blocks: int = 4
    lr: float = 1e-4
    temperature: float = 1.0
    distill_weight: float = 1.0  # loss = this x KL to the teacher + (1 - this) x next-token cross-entropy
    weight_decay: float = 0.0
    seed: int = 0
    compute_dtype: ComputeDtype = "fp32"  # bf16: forward passes under autocast
    device: str = "cpu"  # `cpu`, `cuda` or `cuda:N`
    lora_rank: int | None = None  # None: every weight trains; else low-rank adapters of this rank only
    lora_alpha: float = 16.0  # the adapters' scale is lora_alpha / lora_rank


@dataclass(frozen=True)
class RecoveryResult:
    """What recovery spent and how the loss went."""

    tokens: int
    steps: int
    wall_s: float  # every run's training time together, a resumed run's included
    losses: tuple[float, ...]  # per step
    trained_parameters: int = 0  # what the optimiser updated (the adapters alone with LoRA)
    resumed_tokens: int = 0  # tokens a checkpoint had already trained on (0: trained from the start)
    checkpoint: Path | None = None  # the run's checkpoint file, left for the caller to remove (None: not saved)

    @property
    def tokens_per_second(self) -> float:
        """Training throughput."""
        return self.tokens / self.wall_s if self.wall_s else math.nan


@dataclass(frozen=True)
class Checkpoint:
    """Where recovery keeps its progress (a file per run, named by its inputs), and how often it saves it."""

    folder: Path
    every_s: float = 600.0
    keep_days: float = 7.0  # another run's checkpoint untouched this long is removed when a recovery starts

    def path(self, key: str) -> Path:
        """The checkpoint of the run whose inputs hash to `key` (`run_key`)."""
        return self.folder / f"recovery-{key[:16]}.pt"

    def sweep(self, keep: Path) -> list[Path]:
        """Removes the checkpoints (and saves cut short: `*.partial.pt`) of other runs not written for `keep_days`.

        A stopped run resumes only if its exact inputs come back; one whose settings or data
        changed leaves a file of about 12 bytes a trained parameter that nothing else would remove.

        Args:
            keep: This run's checkpoint, never removed.

        Returns:
            The files removed (each logged); the ones kept are logged with their size.
        """
        if not self.folder.is_dir():
            return []
        cutoff = time.time() - self.keep_days * 86400
        removed, kept = [], []
        for path in sorted(self.folder.glob("recovery-*.pt*")):
            if path == keep:
                continue
            if path.stat().st_mtime < cutoff:
                path.unlink(missing_ok=True)
                removed.append(path)
                log.info("recovery: removed %s, another run's checkpoint untouched for %g days", path, self.keep_days)
            else:
                kept.append(path)
        if kept:
            size = sum(path.stat().st_size for path in kept) / 2**30
            log.info(
                "recovery: %d checkpoint(s) of other runs kept in %s (%.2f GiB; removed once untouched for %g days)",
                len(kept), self.folder, size, self.keep_days,
            )  # fmt: skip
        return removed


class ProgressMarks:
    """A `recover_` progress callback: logs (and appends to `history`) about `points` evenly spaced steps.

    Each `history` row is `{"step": index, "tokens": used, "loss": loss}`. A resumed recovery
    replays the steps it had taken into `history` and counts its rate and time left from there.
    """

    def __init__(self, max_tokens: int, points: int, log: logging.Logger, history: list[dict] | None = None) -> None:
        self.max_tokens, self.log, self.history = max_tokens, log, history
        self.every = max(1, max_tokens // points)
        self.last, self.start = -self.every, 0
        self.counter = Progress("recovery", max_tokens, "tokens")  # the rate and the time left, every 10 s

    def __call__(self, used: int, loss: float) -> None:
        self.counter.update(used - self.start - self.counter.done)
        if self._marked(used, loss):
            self.log.info("recovery: %d / %d tokens, loss %.4f", used, self.max_tokens, loss)

    def resume(self, steps: Sequence[tuple[int, float]]) -> None:
        """Takes the steps a checkpoint had done (tokens used, loss after each) as done."""
        for used, loss in steps:
            self._marked(used, loss)
        self.start = steps[-1][0] if steps else 0
        self.log.info("recovery: resumed at %d / %d tokens", self.start, self.max_tokens)
        self.counter = Progress("recovery", self.max_tokens - self.start, "tokens")

    def _marked(self, used: int, loss: float) -> bool:
        if used - self.last < self.every:
            return False
        self.last = used
        if self.history is not None:
            self.history.append({"step": len(self.history), "tokens": used, "loss": loss})
        return True


def progress_marks(
    max_tokens: int, points: int, log: logging.Logger, history: list[dict] | None = None
) -> ProgressMarks:
    """A `recover_` progress callback that marks about `points` evenly spaced steps (`ProgressMarks`)."""
    return ProgressMarks(max_tokens, points, log, history)


def training_device(name: str) -> torch.device:
    """The torch device `name` (`cpu`, `cuda`, `cuda:N`), refused where torch cannot run on it.

    Raises:
        ConfigError: Not a CPU or CUDA device, or a CUDA device that this torch does not see.
    """
    try:
        device = torch.device(name)
    except RuntimeError as error:
        raise ConfigError(f"recovery device {name!r} is not a torch device (cpu, cuda, cuda:N)") from error
    if device.type not in ("cpu", "cuda"):
        raise ConfigError(f"recovery device {name!r}: recovery trains on cpu or cuda")
    if device.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if (device.index or 0) >= count:
            raise ConfigError(
                f"recovery device {name!r}: torch {torch.__version__} sees {count} CUDA device(s) here; use cpu"
            )
    return device


def compute_dtype_warning(compute_dtype: ComputeDtype, device: str = "cpu") -> str | None:
    """The warning where bf16 is asked of a CPU without bfloat16 instructions (it runs emulated, slower).

    CUDA devices compute bf16 natively (Ampere and later) and get no warning.
    """
    if compute_dtype != "bf16" or device != "cpu" or any(flag in cpu_flags() for flag in NATIVE_BF16_FLAGS):
        return None
    return (
        f"recovery: compute_dtype bf16 on a CPU without bfloat16 instructions ({'/'.join(NATIVE_BF16_FLAGS)}): "
        "it runs emulated, slower than fp32; use fp32 here"
    )


def distillation_loss(student_logits: torch.Tensor, teacher_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) over the vocabulary on softened logits, mean per token, times T²."""
    t = temperature
    log_student = nn.functional.log_softmax(student_logits.float() / t, dim=-1)
    log_teacher = nn.functional.log_softmax(teacher_logits.float() / t, dim=-1)
    kl = (log_teacher.exp() * (log_teacher - log_student)).sum(-1)
    return kl.mean() * t * t


def recover_(
    student: nn.Module,
    teacher: nn.Module,
    blocks: np.ndarray | torch.Tensor,
    settings: RecoverySettings,
    progress: Callable[[int, float], None] | None = None,
    checkpoint: Checkpoint | None = None,
) -> RecoveryResult:
    """Distils `teacher` into `student` on `blocks` until `settings.max_tokens` tokens are used.

    Args:
        student: The cut causal LM (trained in place, left in eval mode).
        teacher: The unpruned model (frozen).
        blocks: (n, length) training token blocks, cycled in a seeded order.
        settings: Budget, optimiser and device.
        progress: Called after each step with (tokens used, loss).
        checkpoint: Where progress is saved and resumed from (None: not saved). The file
            (`RecoveryResult.checkpoint`) is the caller's to remove once what recovery gave is kept.

    Raises:
        ConfigError: No blocks, a budget smaller than one block, or a device torch cannot use.
    """
    blocks = torch.as_tensor(np.asarray(blocks), dtype=torch.long)
    if len(blocks) == 0 or settings.max_tokens < blocks.shape[1]:
        raise ConfigError(
            f"finetune.max_tokens: {settings.max_tokens} is less than one {blocks.shape[-1]}-token block "
            "(or there are no training blocks)"
        )
    device = training_device(settings.device)
    if warning := compute_dtype_warning(settings.compute_dtype, device.type):
        log.warning(warning)
    saving = _Saving(checkpoint, run_key(student, teacher, blocks, settings)) if checkpoint else None
    if saving:
        checkpoint.sweep(saving.path)
    homes = [(model, next(model.parameters()).device) for model in (student, teacher)]
    attached = attach_lora_(student, settings.lora_rank, settings.lora_alpha) if settings.lora_rank else None
    trained = False
    try:
        student.to(device)
        teacher.to(device)
        result = _train(student, teacher, blocks, settings, device, progress, saving)
        trained = True
    finally:
        for model, home in homes:
            model.to(home)
        if attached is not None:
            detach_lora_(attached, merge=trained)  # a failed run leaves the student as it was
    return result


class LoRAProjection(nn.Module):
    """A frozen projection (`nn.Linear`, or GPT-2's transposed `Conv1D`) plus a trainable low-rank update."""

    def __init__(self, base: nn.Module, rank: int, alpha: float) -> None:
        super().__init__()
        self.base = base
        self.transposed = not isinstance(base, nn.Linear)  # Conv1D keeps its weight as (in, out)
        weight = base.weight
        n_in, n_out = (weight.shape[0], weight.shape[1]) if self.transposed else (weight.shape[1], weight.shape[0])
        self.scale = alpha / rank
        self.lora_a = nn.Parameter(torch.empty(rank, n_in, dtype=weight.dtype, device=weight.device))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))
        self.lora_b = nn.Parameter(torch.zeros(n_out, rank, dtype=weight.dtype, device=weight.device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """The frozen projection of `x` plus its scaled low-rank update."""
        return self.base(x) + self.scale * nn.functional.linear(nn.functional.linear(x, self.lora_a), self.lora_b)

    def merged(self) -> nn.Module:
        """The base projection with the update added to its weight (in place)."""
        with torch.no_grad():
            update = self.scale * (self.lora_b @ self.lora_a)
            self.base.weight += update.T if self.transposed else update
        return self.base


@dataclass
class AttachedLoRA:
    """What `attach_lora_` changed: the adapters in place of projections, and every weight's trainable flag."""

    adapters: list[tuple[nn.Module, str, LoRAProjection]]
    requires_grad: dict[nn.Parameter, bool]


def _projections(model: nn.Module) -> list[tuple[nn.Module, str, nn.Module]]:
    """(parent, attribute, module) of every projection inside the decoder layers."""
    from pruneops.models.decoder_layout import layout_of

    found = []
    for layer in layout_of(model).decoder_layers(model):
        for parent in layer.modules():
            for name, child in parent.named_children():
                if isinstance(child, nn.Linear) or type(child).__name__ == "Conv1D":
                    found.append((parent, name, child))
    return found


def attach_lora_(model: nn.Module, rank: int, alpha: float) -> AttachedLoRA:
    """Freezes `model` and wraps each decoder-layer projection with a LoRA adapter.

    Raises:
        ConfigError: A projection no wider than the rank (its update would not be low-rank).
    """
    projections = _projections(model)
    if narrow := [f"{name} {tuple(m.weight.shape)}" for _, name, m in projections if min(m.weight.shape) <= rank]:
        raise ConfigError(f"finetune.lora_rank: {rank} is not below the width of {narrow[0]}; use a smaller rank")
    attached = AttachedLoRA([], {p: p.requires_grad for p in model.parameters()})
    for p in model.parameters():
        p.requires_grad_(False)
    for parent, name, module in projections:
        adapter = LoRAProjection(module, rank, alpha)
        setattr(parent, name, adapter)
        attached.adapters.append((parent, name, adapter))
    return attached


def detach_lora_(attached: AttachedLoRA, merge: bool) -> None:
    """Puts each base projection back (its adapter merged into its weight when `merge`), flags as they were."""
    for parent, name, adapter in attached.adapters:
        setattr(parent, name, adapter.merged() if merge else adapter.base)
    for parameter, flag in attached.requires_grad.items():
        parameter.requires_grad_(flag)


def _train(
    student: nn.Module,
    teacher: nn.Module,
    blocks: torch.Tensor,
    settings: RecoverySettings,
    device: torch.device,
    progress: Callable[[int, float], None] | None,
    saving: _Saving | None = None,
) -> RecoveryResult:
    """The training loop of `recover_`, with student and teacher already on `device`."""
    generator = torch.Generator().manual_seed(settings.seed)
    per_step = settings.batch_blocks * blocks.shape[1]
    total_steps = math.ceil(settings.max_tokens / per_step)
    optimizer = torch.optim.AdamW(
        [p for p in student.parameters() if p.requires_grad], lr=settings.lr, weight_decay=settings.weight_decay
    )
    warmup = max(1, total_steps // 10)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.5 * (1 + math.cos(math.pi * (s - warmup) / max(1, total_steps - warmup)))
        ),
    )
    autocast = torch.autocast(device.type, dtype=torch.bfloat16, enabled=settings.compute_dtype == "bf16")
    teacher.eval()
    student.train()
    order = torch.randperm(len(blocks), generator=generator)
    done = saving.resumed(student, optimizer, schedule, device) if saving else _Done()
    if done.steps and isinstance(progress, ProgressMarks):
        progress.resume(done.steps)
    steps, cursor, started = list(done.steps), done.cursor, time.perf_counter()
    used = steps[-1][0] if steps else 0
    for step in range(len(steps), total_steps):
        take = min(settings.batch_blocks, math.ceil((settings.max_tokens - used) / blocks.shape[1]))
        index = torch.stack([order[(cursor + i) % len(order)] for i in range(take)])
        cursor += take
        batch = blocks[index].to(device)
        with autocast:
            logits = student(input_ids=batch, use_cache=False).logits
        loss = torch.zeros((), dtype=torch.float32, device=device)
        if settings.distill_weight > 0.0:
            with torch.no_grad(), autocast:
                target = teacher(input_ids=batch, use_cache=False).logits
            loss = settings.distill_weight * distillation_loss(logits, target, settings.temperature)
        if settings.distill_weight < 1.0:
            nll = nn.functional.cross_entropy(
                logits[:, :-1].reshape(-1, logits.shape[-1]).float(), batch[:, 1:].reshape(-1)
            )
            loss = loss + (1.0 - settings.distill_weight) * nll
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(student.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        used += batch.numel()
        steps.append((used, loss.item()))
        if saving:
            wall = done.wall_s + time.perf_counter() - started
            saving.maybe_save(_Done(tuple(steps), cursor, wall), student, optimizer, schedule, step + 1 == total_steps)
        if progress:
            progress(used, steps[-1][1])
    student.eval()
    trained = sum(p.numel() for p in student.parameters() if p.requires_grad)
    losses = tuple(loss for _, loss in steps)
    wall = done.wall_s + time.perf_counter() - started
    resumed = done.steps[-1][0] if done.steps else 0
    return RecoveryResult(used, len(steps), wall, losses, trained, resumed, saving.path if saving else None)


def run_key(student: nn.Module, teacher: nn.Module, blocks: torch.Tensor, settings: RecoverySettings) -> str:
    """A SHA-256 of what a recovery's result depends on: its settings, blocks and both models' weights."""
    digest = hashlib.sha256(json.dumps(asdict(settings), sort_keys=True).encode())
    digest.update(blocks.numpy().tobytes())
    for model in (student, teacher):
        for name, tensor in sorted(model.state_dict().items()):
            digest.update(name.encode())
            digest.update(tensor.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


@dataclass(frozen=True)
class _Done:
    """What a recovery has done: (tokens used, loss) after each step, the place in the data, the time spent."""

    steps: tuple[tuple[int, float], ...] = ()
    cursor: int = 0
    wall_s: float = 0.0


@dataclass
class _Saving:
    """A recovery's checkpoint: resumed from where it is this run's, saved every `every_s` and at the end."""

    checkpoint: Checkpoint
    key: str
    saved_at: float = field(default_factory=time.perf_counter)

    @property
    def path(self) -> Path:
        """This run's checkpoint file."""
        return self.checkpoint.path(self.key)

    def resumed(self, student: nn.Module, optimizer, schedule, device: torch.device) -> _Done:
        """What the checkpoint had done, loaded into the student, optimiser and schedule (nothing: not this run's)."""
        path = self.path
        if not path.is_file():
            return _Done()
        try:
            state = torch.load(path, map_location=device, weights_only=True)
        except (RuntimeError, OSError, EOFError) as error:  # a file cut short: not a checkpoint
            log.warning("recovery: %s cannot be read (%s): training from the start", path, error)
            return _Done()
        if state.get("key") != self.key:  # a 16-digit name shared by other inputs: almost never
            log.info("recovery: %s is another run's (its settings, data or weights differ): from the start", path)
            return _Done()
        parameters = dict(student.named_parameters())
        with torch.no_grad():
            for name, value in state["parameters"].items():
                parameters[name].copy_(value)
        optimizer.load_state_dict(state["optimizer"])
        schedule.load_state_dict(state["schedule"])
        steps = tuple((int(used), float(loss)) for used, loss in state["steps"])
        return _Done(steps, int(state["cursor"]), float(state["wall_s"]))

    def maybe_save(self, done: _Done, student: nn.Module, optimizer, schedule, last: bool) -> None:
        """Saves `done` and the training state where `every_s` have passed since the last save, or at the end."""
        if not last and time.perf_counter() - self.saved_at < self.checkpoint.every_s:
            return
        state = {
            "key": self.key,
            "steps": [list(step) for step in done.steps],
            "cursor": done.cursor,
            "wall_s": done.wall_s,
            "parameters": {n: p.detach().cpu() for n, p in student.named_parameters() if p.requires_grad},
            "optimizer": optimizer.state_dict(),
            "schedule": schedule.state_dict(),
        }
        with replaced_whole(self.path) as partial:  # a stop while saving leaves the last whole checkpoint
            torch.save(state, partial)
        self.saved_at = time.perf_counter()
