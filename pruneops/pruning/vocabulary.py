"""Vocabulary trimming: keep only the token embeddings the training texts use.

A pretrained encoder's token embedding is sized for a whole language (MiniLM: 30,522 rows x 384,
half of its 22.7M parameters), while one task's training texts use a fraction of the rows. The
trimmed model keeps those rows and maps every other id to the unknown token's row inside the
model (`SequenceLogits.token_map`), so the tokenizer, the exported inputs and serving are
unchanged. The cost falls on unseen text: a token the training texts never used reads as unknown;
the prune stage reports how often that happens on validation and test text (`unknown_fraction`)
and the validation accuracy before and after.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.core.inputs import pad_id
from pruneops.core.io import Layout
from pruneops.data import Split
from pruneops.data.text import load_tokenizer, unknown_id
from pruneops.training.fit import evaluate

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class VocabularyTrim:
    """What trimming kept: the original ids of the kept rows (sorted) and the unknown token's id."""

    kept_ids: np.ndarray
    unknown_id: int
    rows_before: int

    @property
    def rows_after(self) -> int:
        """Rows of the trimmed embedding."""
        return len(self.kept_ids)


def used_token_ids(input_ids: np.ndarray, attention_mask: np.ndarray, always: list[int]) -> np.ndarray:
    """The sorted distinct ids of the real (unmasked) tokens, with `always` (e.g. pad, unknown) added."""
    used = np.unique(input_ids[attention_mask.astype(bool)])
    return np.union1d(used, np.asarray(always, dtype=np.int64)).astype(np.int64)


def unknown_fraction(input_ids: np.ndarray, attention_mask: np.ndarray, kept_ids: np.ndarray, unknown_id: int) -> float:
    """Fraction of real tokens that read as unknown: outside `kept_ids`, or unknown already."""
    real = input_ids[attention_mask.astype(bool)]
    if real.size == 0:
        return 0.0
    return float(np.mean(~np.isin(real, kept_ids) | (real == unknown_id)))


def _token_embedding(model: nn.Module) -> tuple[nn.Module, nn.Embedding]:
    """The HuggingFace model inside a `SequenceLogits` and its input token embedding."""
    inner = getattr(model, "model", None)
    get = getattr(inner, "get_input_embeddings", None)
    embedding = get() if get is not None else None
    if not hasattr(model, "token_map") or not isinstance(embedding, nn.Embedding):
        raise ConfigError(
            "prune.trim_vocabulary: applies to text models (train.model: hf) only; "
            f"{type(model).__name__} has no token embedding to trim"
        )
    return inner, embedding


def trim_vocabulary_(model: nn.Module, kept_ids: np.ndarray, unknown_id: int) -> VocabularyTrim:
    """Keeps the embedding rows of `kept_ids` (the tokenizer's ids) and maps the others to unknown.

    In place. A model trimmed before is trimmed again through its map: `kept_ids` are always the
    tokenizer's ids.

    Args:
        model: A `SequenceLogits` text classifier.
        kept_ids: Tokenizer ids whose rows stay (sorted, distinct; `unknown_id` among them).
        unknown_id: The tokenizer's unknown token.

    Raises:
        ConfigError: The model has no token embedding (not a text model), or `unknown_id` is not kept.
    """
    inner, embedding = _token_embedding(model)
    kept = torch.as_tensor(np.asarray(kept_ids, dtype=np.int64))
    if not bool((kept == unknown_id).any()):
        raise ConfigError(f"prune.trim_vocabulary: the unknown token (id {unknown_id}) must be kept")
    old_map = model.token_map
    vocab = len(old_map) if old_map is not None else embedding.num_embeddings
    rows = old_map[kept] if old_map is not None else kept
    # Kept rows in id order, except that the padding row keeps its index: RoBERTa and MPNet derive
    # position ids from `input_ids != padding_idx`, so the mapped ids must keep padding where it was.
    position = torch.arange(len(kept))
    pad = embedding.padding_idx
    if pad is not None:
        at = (rows == pad).nonzero().flatten().tolist()
        if not at or pad >= len(kept):
            raise ConfigError(f"prune.trim_vocabulary: the padding token (row {pad}) must be kept at its index")
        position[at[0]], position[pad] = pad, at[0]
    weight = torch.empty(len(kept), embedding.embedding_dim, dtype=embedding.weight.dtype)
    weight[position] = embedding.weight.detach()[rows]
    trimmed = nn.Embedding(len(kept), embedding.embedding_dim, padding_idx=pad)
    trimmed.weight = nn.Parameter(weight)
    unknown_row = position[int(torch.searchsorted(kept, unknown_id))]
    new_map = torch.full((vocab,), int(unknown_row), dtype=torch.int64)
    new_map[kept] = position
    inner.set_input_embeddings(trimmed)
    inner.config.vocab_size = len(kept)
    model.token_map = new_map
    return VocabularyTrim(kept.numpy(), unknown_id, vocab)


def trim_vocabulary(
    model, layout: Layout, train: Split, val: Split, test: Split, val_accuracy: float | None = None
) -> dict:
    """Trims a text model's token embedding to the ids the training texts use; what it cost.

    Kept: every id of a real training token, the tokenizer's special tokens, the padding id and
    the unknown token, which every other id now reads as. The cost on unseen text is measured where the
    model has not trained: the unknown-token rate of validation and test texts, and validation
    accuracy, before and after.

    Args:
        model: The text model, trimmed in place.
        layout: Where the validate stage left the tokenizer.
        train: The split whose tokens are kept.
        val: Measured before and after.
        test: Its unknown-token rate is reported (its accuracy is the benchmark's to report).
        val_accuracy: The untrimmed model's val accuracy when the caller has just measured it.

    Raises:
        ConfigError: Not text data, or a tokenizer without an unknown token.
    """
    if not train.named or "input_ids" not in train.x:
        raise ConfigError("prune.trim_vocabulary: applies to text data (validate.dataset: text) only")
    tokenizer = load_tokenizer(layout.stage_dir("validate") / "tokenizer.json")
    unknown = unknown_id(tokenizer)
    if unknown is None:
        raise ConfigError("prune.trim_vocabulary: the tokenizer has no unknown token to map dropped ids to")
    # Padding fills every batch (as `encode_texts` pads, and as the model's config names it).
    pads = [pad_id(tokenizer), getattr(model.model.config, "pad_token_id", None)]
    always = [unknown, *tokenizer.get_added_tokens_decoder(), *(p for p in pads if p is not None)]
    kept = used_token_ids(train.x["input_ids"], train.x["attention_mask"], always)

    def unknown_rates(ids: np.ndarray | None) -> dict[str, float]:
        everything = np.arange(tokenizer.get_vocab_size(), dtype=np.int64) if ids is None else ids
        return {
            name: unknown_fraction(split.x["input_ids"], split.x["attention_mask"], everything, unknown)
            for name, split in (("val", val), ("test", test))
        }

    before_acc = evaluate(model, val)[0] if val_accuracy is None else val_accuracy
    before = unknown_rates(None)
    trim = trim_vocabulary_(model, kept, unknown)
    after_acc, after = evaluate(model, val)[0], unknown_rates(trim.kept_ids)
    logger.info(
        "vocabulary trimmed to the training texts' %d of %d token ids: unknown tokens on val %.2f%% -> %.2f%%, "
        "val accuracy %.2f%% -> %.2f%%",
        trim.rows_after,
        trim.rows_before,
        100 * before["val"],
        100 * after["val"],
        100 * before_acc,
        100 * after_acc,
    )
    return {
        "rows_before": trim.rows_before,
        "rows_after": trim.rows_after,
        "params_removed": (trim.rows_before - trim.rows_after) * model.model.get_input_embeddings().embedding_dim,
        **{f"unknown_fraction_{k}_before": v for k, v in before.items()},
        **{f"unknown_fraction_{k}_after": v for k, v in after.items()},
        "val_accuracy_before": before_acc,
        "val_accuracy_after": after_acc,
    }
