"""A causal LM's output vocabulary cut to the tokens its domain uses, as a proper distribution.

Every generated token reads the whole output projection (vocabulary x hidden weights; SmolLM2-135M:
49,152 x 576, a fifth of the weights a token reads), and no layer or width cut touches it. This
keeps the exact logits of `K` tokens (those the calibration text uses and those the model itself
expects on it) and scores the rest through `C` *tail* logits: the dropped tokens are grouped by
k-means on their (normalised) output rows, and each group's tail logit is a linear function of the
final hidden state fitted by least squares to the logsumexp of the group's logits. A dropped token
`t` of group `g` then has the logit `tail_g + log prior(t | g)`, with `prior` the model's expected
share of each token on the calibration text: the logits stay a distribution over the whole
vocabulary (perplexity is defined on any text, no token becomes impossible), computed from `K + C`
rows instead of `V`.

The input embedding is untouched (a lookup, not a product). `OutputHead` is the torch form (the
model's output projection); `restrict_exported_head` edits an onnxruntime-genai export of the
same model (built with the head padded to `V` rows) so that its `logits` output is the same
`V`-wide vector.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pruneops.core.errors import PruneOpsError


@dataclass(frozen=True)
class VocabularyCut:
    """Which tokens keep their own row, and how the others are scored.

    Attributes:
        kept: Sorted ids of the tokens whose logits stay exact, (K,).
        group: Per token of the full vocabulary, its tail group (-1 for kept tokens), (V,).
        tail_weight: The tail logits' rows, (C, hidden).
        tail_bias: Their constant terms, (C,).
        log_prior: Per token of the full vocabulary, log of its share within its group (0 for kept
            tokens), (V,).
        fit_rms: Root mean square error of the tail fit on the calibration positions (nats).
    """

    kept: torch.Tensor
    group: torch.Tensor
    tail_weight: torch.Tensor
    tail_bias: torch.Tensor
    log_prior: torch.Tensor
    fit_rms: float

    @property
    def vocabulary(self) -> int:
        """The full vocabulary size."""
        return int(self.log_prior.numel())

    def index_map(self) -> torch.Tensor:
        """Per token id, its row in the `K + C` head output (a dropped token: its group's tail, K + g)."""
        index = len(self.kept) + self.group.clamp(min=0)
        index[self.kept] = torch.arange(len(self.kept))
        return index

    def offset(self) -> torch.Tensor:
        """What is added after the gather: each dropped token's group bias and log prior, (V,)."""
        offset = self.log_prior + self.tail_bias[self.group.clamp(min=0)]
        offset[self.kept] = 0.0
        return offset


class OutputHead(nn.Module):
    """`K` exact rows and the `C` tail rows, gathered back to full-vocabulary logits."""

    def __init__(self, weight: torch.Tensor, cut: VocabularyCut) -> None:
        super().__init__()
        rows = torch.cat([weight[cut.kept], cut.tail_weight.to(weight.dtype)])
        self.weight = nn.Parameter(rows.contiguous())
        self.register_buffer("index", cut.index_map(), persistent=False)
        self.register_buffer("offset", cut.offset().to(weight.dtype), persistent=False)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Full-vocabulary logits of `hidden` (..., hidden)."""
        return (hidden @ self.weight.T).index_select(-1, self.index) + self.offset

    def padded_weight(self) -> torch.Tensor:
        """The `K + C` rows followed by zeros to `V` rows: what the model builder exports, then cut."""
        padded = self.weight.new_zeros(self.index.numel(), self.weight.shape[1])
        padded[: self.weight.shape[0]] = self.weight.detach()
        return padded


@dataclass(frozen=True)
class VocabularyEvidence:
    """The user's text as the cut sees it, gathered in one pass of the model over it.

    Attributes:
        hidden: The normalised last hidden states the output projection reads on the fitted blocks,
            (positions, hidden).
        expected: Per token, the model's expected count on those positions (its softmax summed),
            (V,) float64.
        counts: Per token, its count as a next token in every block of the text, (V,) float64.
    """

    hidden: torch.Tensor
    expected: torch.Tensor
    counts: torch.Tensor


def vocabulary_evidence(
    model: nn.Module, blocks: torch.Tensor | np.ndarray, fit_blocks: int = 96, batch_size: int = 8
) -> VocabularyEvidence:
    """Runs `model` once over the first `fit_blocks` of `blocks`; what `choose_vocabulary` ranks and fits on.

    Args:
        model: A causal LM whose output projection is a bias-free Linear over the full vocabulary.
        blocks: (n, length) token ids of the user's text (the training split).
        fit_blocks: How many of the blocks the model runs on (its expected counts and the tail fit).
        batch_size: Blocks per forward pass.

    Raises:
        PruneOpsError: The model's output projection is not a bias-free Linear.
    """
    head = model.get_output_embeddings()
    if type(head) is not nn.Linear or head.bias is not None:
        raise PruneOpsError(
            "vocabulary cut: the model's output projection is not a bias-free Linear over the vocabulary"
        )
    vocabulary = head.weight.shape[0]
    blocks = torch.as_tensor(np.asarray(blocks))
    states: list[torch.Tensor] = []
    expected = torch.zeros(vocabulary, dtype=torch.float64)

    def collect(module: nn.Module, args: tuple, output: torch.Tensor) -> None:
        states.append(args[0][:, :-1].float().reshape(-1, args[0].shape[-1]))
        expected.add_(torch.softmax(output[:, :-1].float(), -1).sum((0, 1)).double())

    handle = head.register_forward_hook(collect)
    try:
        with torch.inference_mode():
            for start in range(0, min(fit_blocks, len(blocks)), batch_size):
                model(blocks[start : min(start + batch_size, fit_blocks)])
    finally:
        handle.remove()
    counts = torch.bincount(blocks[:, 1:].reshape(-1), minlength=vocabulary).double()
    return VocabularyEvidence(torch.cat(states), expected, counts)


def _groups(rows: torch.Tensor, count: int, iterations: int = 25, seed: int = 0) -> torch.Tensor:
    """k-means of the normalised rows into `count` groups (seeded); each row's group, (n,)."""
    points = nn.functional.normalize(rows, dim=1)
    centres = points[torch.randperm(len(points), generator=torch.Generator().manual_seed(seed))[:count]].clone()
    for _ in range(iterations):
        group = torch.cdist(points, centres).argmin(1)
        sums = torch.zeros_like(centres).index_add_(0, group, points)
        sizes = torch.bincount(group, minlength=count)[:, None]
        centres = torch.where(sizes > 0, sums / sizes.clamp(min=1), centres)
    return torch.cdist(points, centres).argmin(1)


def _group_logsumexp(hidden: torch.Tensor, rows: torch.Tensor, group: torch.Tensor, count: int) -> torch.Tensor:
    """Per position and group, the logsumexp of the group's logits, (positions, count)."""
    out = []
    for chunk in hidden.split(4096):
        logits = chunk @ rows.T
        top = logits.max(1, keepdim=True).values
        sums = torch.zeros(len(chunk), count).index_add_(1, group, torch.exp(logits - top))
        out.append(torch.log(sums.clamp_min(1e-30)) + top)
    return torch.cat(out).double()


def choose_vocabulary(
    model: nn.Module, evidence: VocabularyEvidence, keep: int, tail_groups: int = 256
) -> VocabularyCut:
    """The `keep` tokens the text and the model's predictions on it use most, and the tails fitted on it.

    Tokens are ranked by their share of the text plus their share of the model's expected counts
    (`vocabulary_evidence`), so that tokens the model predicts but the text happens not to contain
    rank too; the tails are fitted on the same positions.

    Args:
        model: The causal LM `evidence` was gathered on.
        evidence: `vocabulary_evidence(model, ...)`: one pass serves every `keep` tried.
        keep: How many tokens keep their own row.
        tail_groups: How many tail logits score the dropped tokens (at most one per dropped token).

    Raises:
        PruneOpsError: `keep` is not below the vocabulary size, `tail_groups` is below 1, or
            `evidence` covers another vocabulary.
    """
    head = model.get_output_embeddings()
    full = head.weight.detach().float()
    vocabulary = full.shape[0]
    if not 0 < keep < vocabulary:
        raise PruneOpsError(f"vocabulary cut: keep {keep} must lie between 1 and the vocabulary ({vocabulary}) - 1")
    if tail_groups < 1:
        raise PruneOpsError(f"vocabulary cut: tail_groups {tail_groups} must be at least 1")
    if evidence.expected.numel() != vocabulary:
        raise PruneOpsError(
            f"vocabulary cut: the evidence covers {evidence.expected.numel()} tokens, the model's head {vocabulary}"
        )
    hidden, expected, counts = evidence.hidden, evidence.expected, evidence.counts
    score = counts / counts.sum() + expected / expected.sum()
    kept = torch.sort(torch.argsort(score, descending=True, stable=True)[:keep]).values
    dropped = torch.ones(vocabulary, dtype=torch.bool)
    dropped[kept] = False
    count = min(tail_groups, vocabulary - keep)
    members = _groups(full[dropped], count) if count > 1 else torch.zeros(vocabulary - keep, dtype=torch.long)
    target = _group_logsumexp(hidden, full[dropped], members, count)
    design = torch.cat([hidden.double(), torch.ones(len(hidden), 1, dtype=torch.float64)], 1)
    solution = torch.linalg.lstsq(design, target).solution  # (hidden + 1, count)
    rms = float((design @ solution - target).pow(2).mean().sqrt())
    group = torch.full((vocabulary,), -1, dtype=torch.long)
    group[dropped] = members
    prior = expected[dropped] + 1e-9
    within = prior / torch.zeros(count, dtype=torch.float64).index_add_(0, members, prior)[members]
    log_prior = torch.zeros(vocabulary)
    log_prior[dropped] = torch.log(within).float()
    return VocabularyCut(kept, group, solution[:-1].T.float(), solution[-1].float(), log_prior, rms)


def cut_vocabulary_(model: nn.Module, cut: VocabularyCut) -> None:
    """Replaces the model's output projection by an `OutputHead` (the input embedding is kept, untied)."""
    head = model.get_output_embeddings()
    weight = head.weight.detach()
    embedding = model.get_input_embeddings()
    if embedding.weight is head.weight:
        embedding.weight = nn.Parameter(weight.clone())
    model.set_output_embeddings(OutputHead(weight, cut))
    model.config.tie_word_embeddings = False


def vocabulary_cut_copy(
    model: nn.Module, evidence: VocabularyEvidence, keep: int, tail_groups: int = 256
) -> tuple[nn.Module, VocabularyCut]:
    """A copy of `model` with its vocabulary cut (`choose_vocabulary`'s arguments); `model` is unchanged."""
    cut = choose_vocabulary(model, evidence, keep, tail_groups)
    trimmed = copy.deepcopy(model)
    cut_vocabulary_(trimmed, cut)
    return trimmed, cut
