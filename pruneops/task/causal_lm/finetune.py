"""`finetune` for a causal LM: distillation from the dense model within a token budget."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from pruneops.config import FinetuneConfig
from pruneops.core.io import Layout, dump_json, staged_output_paths
from pruneops.models.decoders import load_causal_lm, save_causal_lm
from pruneops.models.language import SELF_TEXT_PROMPT, block_losses, perplexity_from_losses, self_written_blocks
from pruneops.pipeline.stages import StageReport
from pruneops.reports.plots import plot_history
from pruneops.task.causal_lm.common import MODEL_DIR, load_blocks, read_stage_json
from pruneops.training.recovery import (
    Checkpoint,
    RecoverySettings,
    compute_dtype_warning,
    progress_marks,
    recover_,
    training_device,
)

log = logging.getLogger(__name__)

# Recovery saves its progress this often (and at its end) under `state/cache/recovery/`, a file per run
# named by its inputs: a stopped run of the same inputs resumes there, losing at most this much
# training. About 2 s a save for a 135M model. DVC experiments' worktrees share their project's
# `state/cache/`, so a rerun of an experiment resumes too.
CHECKPOINT_EVERY_S = 600.0


@dataclass(frozen=True)
class RecoveryReport(StageReport):
    """What distillation spent and what it gave back."""

    tokens: int
    steps: int
    wall_s: float
    tokens_per_second: float
    val_perplexity_before: float
    val_perplexity: float
    dense_val_perplexity: float
    checkpoint: Path
    compute_dtype: str = "fp32"
    device: str = "cpu"
    warnings: tuple[str, ...] = ()
    lora_rank: int | None = None
    trained_parameters: int = 0  # what the optimiser updated (the adapters alone with LoRA)
    self_text_blocks: int = 0  # recovery blocks the dense model wrote itself (`self_text_fraction`)
    resumed_tokens: int = 0  # tokens trained on before a stop, resumed from the checkpoint (0: one run)

    def summary(self) -> str:
        resumed = f" (resumed at {self.resumed_tokens:,})" if self.resumed_tokens else ""
        return (
            f"{self.tokens:,} tokens{resumed} in {self.wall_s / 60:.1f} min on {self.device}: validation perplexity "
            f"{self.val_perplexity_before:.2f} -> {self.val_perplexity:.2f} (dense {self.dense_val_perplexity:.2f}) "
            f"-> {self.checkpoint}"
        )


def _with_self_text(dense: torch.nn.Module, train: np.ndarray, config: FinetuneConfig) -> tuple[np.ndarray, int]:
    """The training blocks and, with `self_text_fraction`, that share of blocks the dense model writes itself.

    Each written block starts from the first tokens of a training block (its BOS, if any, included)
    and is sampled by the dense model; written blocks make up `self_text_fraction` of the mixed set.
    Where `max_tokens` reads fewer blocks than that set would hold, only what it reads is made: that
    many blocks, the share written and the rest drawn from the training blocks (writing costs a
    generation per token, so blocks recovery would never read are not written).
    """
    if not config.self_text_fraction:
        return train, 0
    fraction, rng = config.self_text_fraction, np.random.default_rng(config.seed)
    count = max(1, round(len(train) * fraction / (1 - fraction)))
    starts = train[rng.integers(0, len(train), count), :SELF_TEXT_PROMPT]
    read = math.ceil(config.max_tokens / train.shape[1])  # blocks recovery reads
    if 0 < read < len(train) + count:
        count = max(1, round(read * fraction))
        starts = starts[:count]
        train = train[np.sort(rng.choice(len(train), max(1, read - count), replace=False))]
    written = self_written_blocks(dense, starts, train.shape[1], config.seed)
    return np.concatenate([train, written.astype(train.dtype)]), count


def recover_decoder(config: FinetuneConfig, layout: Layout) -> RecoveryReport:
    """Distils the dense decoder into the pruned one within `finetune.max_tokens` training tokens.

    `distill_weight` x logit KL from the dense model (at `distill_temperature`) + the rest x the
    next-token loss on the training blocks; AdamW at `lr` with warm-up and cosine decay,
    `batch_size` blocks per step; 0 tokens passes the pruned model on as it is. With
    `self_text_fraction`, that share of the blocks is text the dense model writes itself
    (`self_written_blocks`): recovery then also distils what the model does beyond the corpus.
    Recovery saves its progress every `CHECKPOINT_EVERY_S` under `state/cache/recovery/` and a
    stopped run of the same inputs resumes there; the checkpoint goes once the stage's outputs are written.
    """
    torch.set_num_threads(config.threads)
    if config.max_tokens:
        training_device(config.device)  # a device torch does not see is refused before anything loads
    dense, tokenizer = load_causal_lm(layout.stage_dir("train") / MODEL_DIR)
    model, _ = load_causal_lm(layout.stage_dir("prune") / MODEL_DIR)
    blocks = load_blocks(layout)
    before = perplexity_from_losses(block_losses(model, blocks["val"]), 0).value
    history: list[dict] = []
    tokens = steps = trained = written = resumed = 0
    progress_file: Path | None = None  # recovery's checkpoint, removed once the outputs are written
    wall = 0.0
    refused = not read_stage_json(layout, "prune", "plan.json").get("pruned", True)  # dense passed on
    if config.max_tokens and not refused:
        settings = RecoverySettings(
            max_tokens=config.max_tokens,
            batch_blocks=config.batch_size,
            lr=config.lr,
            temperature=config.distill_temperature,
            distill_weight=config.distill_weight,
            weight_decay=config.weight_decay,
            seed=config.seed,
            compute_dtype=config.compute_dtype,
            device=config.device,
            lora_rank=config.lora_rank,
            lora_alpha=config.lora_alpha,
        )
        progress = progress_marks(config.max_tokens, 20, log, history)
        train, written = _with_self_text(dense, blocks["train"], config)
        saving = Checkpoint(layout.state_dir() / "cache" / "recovery", CHECKPOINT_EVERY_S)
        result = recover_(model, dense, train, settings, progress, saving)
        tokens, steps, wall, trained = result.tokens, result.steps, result.wall_s, result.trained_parameters
        resumed, progress_file = result.resumed_tokens, result.checkpoint
    warning = compute_dtype_warning(config.compute_dtype, config.device) if config.max_tokens else None
    if refused and config.max_tokens:
        warning = "the prune stage passed the dense model on (its gate, or strategy none): nothing to recover"
    after = perplexity_from_losses(block_losses(model, blocks["val"]), 0).value
    dense_ppl = perplexity_from_losses(block_losses(dense, blocks["val"]), 0).value
    out, plots = layout.stage_dir("finetune"), layout.plots("finetune")
    with staged_output_paths(out, layout.metrics("finetune"), plots) as staged:
        save_causal_lm(model, tokenizer, staged.dir(out) / MODEL_DIR)
        dump_json(history, staged.dir(plots) / "history.json")
        rows = history or [{"tokens": 0, "loss": 0.0}]
        png = staged.path(plots) / "history.png"
        plot_history(rows, "tokens", [("training loss", ["loss"])], "Recovery", png)
        report = RecoveryReport(
            tokens=tokens,
            steps=steps,
            wall_s=wall,
            tokens_per_second=tokens / wall if wall else 0.0,
            val_perplexity_before=before,
            val_perplexity=after,
            dense_val_perplexity=dense_ppl,
            checkpoint=out / MODEL_DIR,
            compute_dtype=config.compute_dtype,
            device=config.device,
            warnings=(warning,) if warning else (),
            lora_rank=config.lora_rank,
            trained_parameters=trained,
            self_text_blocks=written,
            resumed_tokens=resumed,
        )
        dump_json(report.metrics(), staged.path(layout.metrics("finetune")))
    if progress_file is not None:  # what recovery gave is kept: a later run of the same inputs is a DVC cache hit
        progress_file.unlink(missing_ok=True)
    return report
