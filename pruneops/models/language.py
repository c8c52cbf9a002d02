"""Quality of a causal LM: perplexity on token blocks (with a bootstrap interval) and a zero-shot check.

Perplexity is exp of the mean next-token negative log-likelihood over every predicted token of
the blocks. Its interval resamples whole blocks (tokens within a block are not independent).
The zero-shot check needs no labels from us: for each labelled text of the user's file, the
model scores `prompt.format(text=...) + " " + label` for every label and predicts the most
likely; its accuracy is reported with a Wilson interval.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pruneops.core.progress import Progress
from pruneops.data.corpus import affixes_of, hf_encode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Perplexity:
    """Perplexity of a model on blocks, with a 95 % bootstrap interval over blocks."""

    value: float
    low: float
    high: float
    tokens: int
    block_nll: tuple[float, ...]  # mean NLL per block (for paired comparisons)

    def __str__(self) -> str:
        return f"{self.value:.2f} [{self.low:.2f}, {self.high:.2f}]"


def block_losses(model: nn.Module, blocks: torch.Tensor | np.ndarray, batch_size: int = 8) -> np.ndarray:
    """Mean next-token NLL of each block (n,), computed on the device the model's weights are on."""
    blocks = torch.as_tensor(blocks)
    device = next(model.parameters(), torch.empty(0)).device  # a model without weights runs on the CPU
    out = []
    with torch.inference_mode(), Progress("scoring perplexity", len(blocks), "blocks") as counter:
        for start in range(0, len(blocks), batch_size):
            ids = blocks[start : start + batch_size].to(device)
            logits = model(input_ids=ids, use_cache=False).logits[:, :-1].float()
            nll = nn.functional.cross_entropy(logits.transpose(1, 2), ids[:, 1:], reduction="none")
            out.append(nll.mean(1).double().cpu().numpy())
            counter.update(len(ids))
    return np.concatenate(out)


def perplexity(
    model: nn.Module, blocks: torch.Tensor | np.ndarray, batch_size: int = 8, resamples: int = 2000, seed: int = 0
) -> Perplexity:
    """Perplexity with a bootstrap interval (blocks resampled with replacement)."""
    losses = block_losses(model, blocks, batch_size)
    return perplexity_from_losses(losses, int(np.asarray(blocks).shape[1] - 1) * len(losses), resamples, seed)


def perplexity_from_losses(losses: np.ndarray, tokens: int, resamples: int = 2000, seed: int = 0) -> Perplexity:
    """Perplexity and its bootstrap interval from per-block mean losses (equal-length blocks)."""
    rng = np.random.default_rng(seed)
    draws = losses[rng.integers(0, len(losses), size=(resamples, len(losses)))].mean(1)
    low, high = np.quantile(draws, [0.025, 0.975])
    return Perplexity(math.exp(losses.mean()), math.exp(low), math.exp(high), tokens, tuple(float(x) for x in losses))


def paired_ratio_interval(
    candidate: Perplexity, reference: Perplexity, resamples: int = 2000, seed: int = 0
) -> tuple[float, float, float]:
    """Candidate/reference perplexity ratio and its 95 % interval, resampling the same blocks for both."""
    a, b = np.asarray(candidate.block_nll), np.asarray(reference.block_nll)
    rng = np.random.default_rng(seed)
    index = rng.integers(0, len(a), size=(resamples, len(a)))
    draws = np.exp(a[index].mean(1) - b[index].mean(1))
    low, high = np.quantile(draws, [0.025, 0.975])
    return math.exp(a.mean() - b.mean()), float(low), float(high)


def zero_shot_accuracy(
    model: nn.Module, tokenizer: object, examples: list[tuple[str, str]], prompt: str, labels: list[str]
) -> tuple[float, float, float]:
    """Accuracy of choosing each example's label by log-likelihood, with a 95 % Wilson interval.

    Args:
        model: A causal LM (HuggingFace interface: `input_ids` in, `.logits` out).
        tokenizer: Its tokenizer.
        examples: (text, label) pairs; labels must be among `labels`.
        prompt: A template with `{text}`; the label follows it after one space.
        labels: The answers compared (e.g. ["negative", "positive"]).
    """
    correct = 0
    prefix = list(affixes_of(hf_encode(tokenizer)).prefix)  # the BOS a model trained with one always saw first
    with torch.inference_mode():
        for text, label in examples:
            context = prefix + tokenizer(prompt.format(text=text), add_special_tokens=False)["input_ids"]
            scores = []
            for answer in labels:
                target = tokenizer(" " + answer, add_special_tokens=False)["input_ids"]
                ids = torch.tensor([context + target])
                logits = model(input_ids=ids, use_cache=False).logits[0, len(context) - 1 : -1]
                scores.append(float(torch.log_softmax(logits.float(), -1)[range(len(target)), target].sum()))
            correct += labels[int(np.argmax(scores))] == label
    return (*wilson(correct, len(examples)),)


def wilson(successes: int, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """A proportion and its Wilson score interval."""
    if n == 0:
        return math.nan, math.nan, math.nan
    p = successes / n
    centre = (p + z * z / (2 * n)) / (1 + z * z / n)
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / (1 + z * z / n)
    return p, centre - half, centre + half


SELF_TEXT_PROMPT = 8  # tokens of a training block a self-written block starts from


def self_written_blocks(model: nn.Module, starts: np.ndarray, length: int, seed: int, batch: int = 8) -> np.ndarray:
    """Blocks of `length` tokens the model writes itself, sampled (temperature 1) after each row of `starts`.

    Text a causal LM generates follows what it learnt in pretraining, not the user's corpus: mixed
    into recovery, distillation also keeps what the model does beyond the corpus, with no data the
    user lacks. End of sequence is not sampled, so every block is full.
    """
    torch.manual_seed(seed)
    eos = model.generation_config.eos_token_id
    blocks = []
    with Progress("self-written text: generating", len(starts), "blocks") as counter, torch.inference_mode():
        for first in range(0, len(starts), batch):
            prompt = torch.as_tensor(np.asarray(starts[first : first + batch]), dtype=torch.long)
            out = model.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=length - prompt.shape[1],
                min_new_tokens=length - prompt.shape[1],
                pad_token_id=eos if isinstance(eos, int) else (eos or [0])[0],
            )
            blocks.append(out.numpy())
            counter.update(len(prompt))
    return np.concatenate(blocks)[:, :length]


def calibration_blocks(model: nn.Module, train: np.ndarray, count: int, self_fraction: float, seed: int) -> np.ndarray:
    """The blocks a cut is calibrated on: the first training blocks, a share of them written by the model itself.

    Args:
        model: The dense causal LM (it writes its share after each block's first `SELF_TEXT_PROMPT` tokens).
        train: (n, length) training blocks.
        count: Blocks in all (at most n).
        self_fraction: The share the model writes (0: the corpus alone).
        seed: Its sampling seed.

    Returns:
        (count, length) blocks: the corpus's first, then the written ones.
    """
    count = min(count, len(train))
    written = round(count * self_fraction)
    if not written:
        return train[:count]
    own = self_written_blocks(model, train[:written, :SELF_TEXT_PROMPT], train.shape[1], seed)
    log.info("calibration: %d blocks, %d of them written by the model", count, written)
    return np.concatenate([train[: count - written], own.astype(train.dtype)])
