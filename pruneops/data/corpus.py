"""Text corpora for causal LMs: documents, a split by document, fixed token blocks.

A corpus is plain text (documents separated by blank lines), JSONL, CSV/TSV or Parquet
(one document per row in `text_column`), optionally .gz/.bz2. Documents are split into train,
validation and test by a seeded permutation of whole documents (no document straddles two
splits), then each split's documents are tokenised by the model's own tokenizer with the special
tokens it adds itself (BOS), joined with the end-of-sequence token and cut into blocks of
`block_length` tokens that each start as the model's training sequences did (the tail is dropped).
"""

from __future__ import annotations

import bz2
import gzip
import hashlib
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.core.errors import DataError, DataValidationError


@dataclass(frozen=True)
class CorpusChecks:
    """What a corpus must satisfy (failures stop validation with one line per check)."""

    min_document_chars: int = 1
    max_document_chars: int = 1_000_000
    max_duplicate_fraction: float = 0.0  # documents that repeat an earlier one (whitespace and case ignored)
    max_unknown_token_rate: float = 0.01  # tokens the tokenizer maps to its unknown token


@dataclass(frozen=True)
class CorpusSplits:
    """Token blocks per split, and what they were made from."""

    train: np.ndarray  # (n, block_length) int64
    val: np.ndarray
    test: np.ndarray
    documents: dict[str, int]  # documents per split
    tokens: dict[str, int]  # tokens per split before blocking


def read_documents(path: str | Path, text_column: str = "text", encoding: str = "utf-8") -> list[str]:
    """The documents of a corpus file.

    Raises:
        DataError: The file is missing, unreadable or has no such column.
    """
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise DataError(f"validate.path: corpus {path} does not exist")
    suffixes = [s for s in path.suffixes if s not in (".gz", ".bz2")]
    kind = suffixes[-1] if suffixes else ".txt"
    try:
        if kind in (".txt", ".md"):
            opener = {".gz": gzip.open, ".bz2": bz2.open}.get(path.suffix, open)
            with opener(path, "rt", encoding=encoding) as handle:
                return [d.strip() for d in handle.read().split("\n\n") if d.strip()]
        if kind == ".jsonl":
            table = pd.read_json(path, lines=True, encoding=encoding)
        elif kind == ".parquet":
            table = pd.read_parquet(path)
        else:
            table = pd.read_csv(path, sep="\t" if kind == ".tsv" else ",", encoding=encoding)
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise DataError(f"validate.path: {path} is not a readable {kind} corpus in {encoding}: {exc}") from exc
    if text_column not in table.columns:
        raise DataError(
            f"validate.text_column: {path} has no column {text_column!r} (columns: {list(table.columns)[:10]})"
        )
    return [str(t) for t in table[text_column].fillna("")]


def check_documents(documents: list[str], checks: CorpusChecks) -> list[str]:
    """Failed checks on the raw documents, one line each (empty: all hold)."""
    failures = []
    if not documents:
        return ["the corpus holds no documents"]
    short = sum(len(d) < checks.min_document_chars for d in documents)
    if short:
        failures.append(f"{short} documents shorter than {checks.min_document_chars} characters")
    long = sum(len(d) > checks.max_document_chars for d in documents)
    if long:
        failures.append(f"{long} documents longer than {checks.max_document_chars} characters")
    duplicates = len(documents) - len({_fingerprint(d) for d in documents})
    if duplicates > checks.max_duplicate_fraction * len(documents):
        failures.append(f"{duplicates} duplicate documents (allowed: {checks.max_duplicate_fraction:.1%})")
    return failures


def _fingerprint(document: str) -> str:
    return hashlib.sha1(" ".join(document.lower().split()).encode()).hexdigest()


def split_documents(documents: list[str], val_fraction: float, test_fraction: float, seed: int) -> dict[str, list[str]]:
    """Train/validation/test by whole documents, drawn by a seeded permutation."""
    order = np.random.default_rng(seed).permutation(len(documents))
    n_test = max(1, round(test_fraction * len(documents)))
    n_val = max(1, round(val_fraction * len(documents)))
    if n_test + n_val >= len(documents):
        raise DataError(f"validate: {len(documents)} documents cannot be split into train, validation and test")
    parts = {"test": order[:n_test], "val": order[n_test : n_test + n_val], "train": order[n_test + n_val :]}
    return {name: [documents[i] for i in sorted(index)] for name, index in parts.items()}


@dataclass(frozen=True)
class Affixes:
    """The ids a tokenizer adds around a text of its own accord: BOS before (Llama, Gemma), EOS after for some."""

    prefix: tuple[int, ...]
    suffix: tuple[int, ...]


Encode = Callable[[str, bool], list[int]]  # (text, add the tokenizer's own special tokens) -> ids


def hf_encode(tokenizer: object) -> Encode:
    """The encode function of a transformers tokenizer."""
    return lambda text, special: list(tokenizer(text, add_special_tokens=special)["input_ids"])


def affixes_of(encode: Encode) -> Affixes:
    """What `encode` adds around a text when asked for its special tokens (read from the tokenizer, not assumed)."""
    plain, full = encode(_PROBE, False), encode(_PROBE, True)
    for start in range(len(full) - len(plain) + 1):
        if full[start : start + len(plain)] == plain:
            return Affixes(tuple(full[:start]), tuple(full[start + len(plain) :]))
    return Affixes((), ())  # a tokenizer that rewrites the text itself: nothing it adds can be told apart


_PROBE = "The quick brown fox."


def to_blocks(documents: list[str], tokenizer: object, block_length: int) -> tuple[np.ndarray, int]:
    """Token blocks of the documents as the model was trained on them; returns (blocks, tokens).

    Each document is tokenised as its tokenizer does on its own (with its BOS, where it adds one)
    and followed by end-of-sequence (or the suffix the tokenizer adds itself); documents are joined,
    and every block starts with the tokenizer's prefix: a block that begins mid-document gets the
    BOS a model trained with one always saw first (SmolLM2's and GPT-2's tokenizers add none).
    """
    encode = hf_encode(tokenizer)
    affixes = affixes_of(encode)
    eos = tokenizer.eos_token_id
    separator = list(affixes.suffix) or ([eos] if eos is not None else [])
    stream: list[int] = []
    for document in documents:
        stream.extend([*affixes.prefix, *encode(document, False), *separator])
    blocks = _blocks(stream, list(affixes.prefix), block_length)
    return np.asarray(blocks, dtype=np.int64).reshape(len(blocks), block_length), len(stream)


def _blocks(stream: list[int], prefix: list[int], length: int) -> list[list[int]]:
    """Consecutive blocks of `length` ids, each starting with `prefix` (the tail is dropped)."""
    blocks, position, width = [], 0, len(prefix)
    while True:
        if stream[position : position + width] == prefix:  # at a document's start, or no prefix at all
            block, step = stream[position : position + length], length
        else:
            block, step = prefix + stream[position : position + length - width], length - width
        if len(block) < length or step <= 0:
            return blocks
        blocks.append(block)
        position += step


def unknown_token_rate(blocks: np.ndarray, tokenizer: object) -> float:
    """Fraction of tokens that are the tokenizer's unknown token (0 when it has none)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None or blocks.size == 0:
        return 0.0
    return float((blocks == unk).mean())


def build_corpus(
    documents: list[str],
    tokenizer: object,
    block_length: int,
    val_fraction: float = 0.1,
    test_fraction: float = 0.1,
    seed: int = 0,
    checks: CorpusChecks | None = None,
) -> CorpusSplits:
    """Checks, splits and tokenises a corpus.

    Raises:
        DataValidationError: A check failed, or a split holds no whole block.
    """
    checks = checks or CorpusChecks()
    failures = check_documents(documents, checks)
    if failures:
        raise DataValidationError(f"corpus failed {len(failures)} checks: {failures[0]}", failures)
    parts = split_documents(documents, val_fraction, test_fraction, seed)
    blocks, tokens = {}, {}
    for name, docs in parts.items():
        blocks[name], tokens[name] = to_blocks(docs, tokenizer, block_length)
        if len(blocks[name]) == 0:
            raise DataValidationError(
                f"corpus: the {name} split ({tokens[name]} tokens) holds no block of {block_length} tokens",
                [f"{name}: {tokens[name]} tokens"],
            )
    leaked = {_fingerprint(d) for d in parts["train"]} & {_fingerprint(d) for d in parts["test"]}
    rate = unknown_token_rate(blocks["train"], tokenizer)
    failures = [f"{len(leaked)} test documents repeat a training document"] if leaked else []
    if rate > checks.max_unknown_token_rate:
        failures.append(f"unknown-token rate {rate:.2%} above {checks.max_unknown_token_rate:.2%}")
    if failures:
        raise DataValidationError(f"corpus failed {len(failures)} checks: {failures[0]}", failures)
    return CorpusSplits(**blocks, documents={k: len(v) for k, v in parts.items()}, tokens=tokens)


def read_labelled(path: str | Path, text_column: str, label_column: str) -> list[tuple[str, str]]:
    """(text, label) pairs of a labelled file (CSV/TSV/JSONL/Parquet), for the zero-shot check."""
    import pandas as pd

    path = Path(path)
    kind = [s for s in path.suffixes if s not in (".gz", ".bz2")][-1:] or [".csv"]
    try:
        if kind[0] == ".jsonl":
            table = pd.read_json(path, lines=True)
        elif kind[0] == ".parquet":
            table = pd.read_parquet(path)
        else:
            table = pd.read_csv(path, sep="\t" if kind[0] == ".tsv" else ",")
    except (OSError, ValueError) as exc:
        raise DataError(f"{path}: not a readable labelled table: {exc}") from exc
    missing = {text_column, label_column} - set(table.columns)
    if missing:
        raise DataError(f"{path}: no column {sorted(missing)[0]!r}")
    return [(str(t), str(y)) for t, y in zip(table[text_column], table[label_column], strict=True)]


def describe(splits: CorpusSplits) -> str:
    """One line: documents, tokens and blocks per split."""
    return json.dumps({k: [splits.documents[k], splits.tokens[k], len(getattr(splits, k))] for k in splits.documents})
