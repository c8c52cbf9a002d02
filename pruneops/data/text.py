"""Labelled text for `validate.dataset: text`: reading, tokenising, checks and drift statistics.

A table of sentences (CSV/TSV/JSONL/Parquet, plain or `.gz`/`.bz2`) with a text column and a
label column (strings or integers) becomes named int64 arrays `input_ids` and `attention_mask`
of one fixed length, through the model's own `tokenizer.json` (the `tokenizers` library: the same
code the torch-free serving image runs). Duplicates and train/test leakage are judged on
normalised text (case-folded, whitespace collapsed), not on token ids.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pruneops.core.errors import ConfigError, DataError
from pruneops.core.inputs import encode_texts as tokenize
from pruneops.core.inputs import unknown_id

__all__ = ["tokenize", "unknown_id"]  # validate and serving tokenise with the same code

TEXT_SUFFIXES = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".txt": "tsv",
    ".jsonl": "jsonl",
    ".json": "jsonl",
    ".parquet": "parquet",
}
COMPRESSIONS = {".gz": "gzip", ".bz2": "bz2"}
LENGTH_BINS = (0, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 384, 512, 1_000_000)


@dataclass(frozen=True)
class TextTable:
    """Texts and labels as read: `labels` index `label_names` (strings) or are the integers given."""

    texts: list[str]
    labels: np.ndarray
    label_names: list[str] | None
    dropped: dict[str, int]


def refuse_duplicated_header(path: Path, **read: object) -> None:
    """Refuses a CSV whose header names a column twice (pandas would rename the second `name.1`).

    Raises:
        DataError: Naming the file and the repeated names.
    """
    header = pd.read_csv(path, header=None, nrows=1, dtype=str, keep_default_na=False, **read)
    names = [str(v) for v in header.iloc[0].tolist()] if len(header) else []
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise DataError(f"{path}: the header names a column more than once: {repeated[:5]}; rename them")


def describe_columns(columns) -> str:
    """The columns a table was read with, for an error message, without echoing a file's first line.

    A file that is not a table reads as one column named by its whole first line (a key, a
    password): that is never shown, and names are cut to 24 characters, at most 10 of them.
    """
    names = [str(c) for c in columns]
    if len(names) < 2:
        return "the file reads as a single column (is it a CSV/TSV table with a header line?)"
    shown = [n if len(n) <= 24 else n[:23] + "…" for n in names[:10]]
    return f"columns: {shown}" + (f" (+{len(names) - 10} more)" if len(names) > 10 else "")


def _format(path: Path) -> tuple[str, str | None]:
    suffixes = [s.lower() for s in path.suffixes]
    compression = COMPRESSIONS.get(suffixes[-1]) if suffixes else None
    base = suffixes[-2] if compression and len(suffixes) > 1 else (suffixes[-1] if suffixes else "")
    if base not in TEXT_SUFFIXES:
        known = ", ".join(sorted(TEXT_SUFFIXES))
        given = "".join(suffixes) or "no suffix"
        raise DataError(f"{path}: cannot tell the format from {given} (known: {known}, each plain or .gz/.bz2)")
    return TEXT_SUFFIXES[base], compression


def read_frame(path: Path, encoding: str) -> pd.DataFrame:
    """The table at `path`, format from its suffix, decompressed by pandas.

    Raises:
        DataError: Unknown format, wrong encoding or unreadable file (names the file and the cause).
    """
    kind, compression = _format(path)
    try:
        if kind == "parquet":
            return pd.read_parquet(path)
        if kind == "jsonl":
            return pd.read_json(path, lines=True, encoding=encoding, compression=compression, dtype=False)
        sep = "\t" if kind == "tsv" else ","
        refuse_duplicated_header(path, sep=sep, encoding=encoding, compression=compression)
        return pd.read_csv(path, sep=sep, encoding=encoding, compression=compression, dtype=str, keep_default_na=False)
    except UnicodeDecodeError as exc:
        raise DataError(
            f"{path}: not {encoding} text ({exc.reason} at byte {exc.start}); set validate.encoding"
        ) from None
    except LookupError:
        raise ConfigError(f"validate.encoding: unknown encoding {encoding!r}") from None
    except Exception as exc:  # pandas raises many unrelated types for unreadable files
        raise DataError(f"{path}: cannot read table ({type(exc).__name__}: {exc})") from None


def _labels(values: pd.Series, where: str) -> tuple[np.ndarray, list[str] | None]:
    """Integer labels as they are; any other label set mapped to 0.. in sorted order of its names."""
    as_text = values.astype(str).str.strip()
    if as_text.str.fullmatch(r"\d+").all():
        return as_text.astype(np.int64).to_numpy(), None
    names = sorted(as_text.unique().tolist())
    if len(names) < 2:
        raise DataError(f"{where}: needs at least two labels, found {names}")
    index = {n: i for i, n in enumerate(names)}
    return as_text.map(index).to_numpy(dtype=np.int64), names


def read_text_table(
    path: Path, text_column: str, label_column: str, encoding: str = "utf-8", exclude_labels: list[str] | None = None
) -> TextTable:
    """Texts and labels of a table; rows whose label is in `exclude_labels` are dropped first.

    Raises:
        DataError: File, column or label problems, named.
    """
    frame = read_frame(Path(path), encoding)
    frame.columns = [str(c) for c in frame.columns]
    for column in (text_column, label_column):
        if column not in frame.columns:
            raise DataError(f"{path}: column {column!r} not found; {describe_columns(frame.columns)}")
    labels = frame[label_column]
    missing = labels.isna() | (labels.astype(str).str.strip() == "")
    dropped = {"empty label": int(missing.sum())}
    keep = ~missing
    if exclude_labels:
        excluded = labels.astype(str).str.strip().isin(exclude_labels)
        dropped["excluded label"] = int((excluded & keep).sum())
        keep &= ~excluded
    frame = frame[keep]
    if len(frame) < 2:
        raise DataError(f"{path}: fewer than 2 labelled rows")
    y, names = _labels(frame[label_column], f"{path}: column {label_column!r}")
    texts = ["" if pd.isna(t) else str(t) for t in frame[text_column].tolist()]
    return TextTable(texts, y, names, dropped)


_SPACE = re.compile(r"\s+")


def normalise(text: str) -> str:
    """Case-folded with whitespace collapsed: what counts as the same sentence."""
    return _SPACE.sub(" ", text).strip().casefold()


def text_digests(texts: list[str]) -> np.ndarray:
    """A hash of each normalised text (duplicates and leakage)."""
    return np.array([hashlib.blake2b(normalise(t).encode(), digest_size=12).hexdigest() for t in texts])


def load_tokenizer(path: str | Path):
    """The `tokenizers.Tokenizer` of a `tokenizer.json` file, or of a model folder holding one.

    Raises:
        ConfigError: No tokenizer file there, or the tokenizers library is not installed.
    """
    try:
        from tokenizers import Tokenizer
    except ImportError:
        raise ConfigError(
            "validate.tokenizer: text datasets need the tokenizers library (the `hf` extra: "
            "pip install -c constraints.txt -e '.[hf]', or make install-dev)"
        ) from None

    path = Path(path)
    file = path / "tokenizer.json" if path.is_dir() else path
    if not file.is_file():
        raise ConfigError(f"validate.tokenizer: {file} not found (a tokenizer.json, or a folder holding one)")
    try:
        return Tokenizer.from_file(str(file))
    except Exception as exc:  # tokenizers raises a bare Exception for malformed files
        raise ConfigError(f"validate.tokenizer: {file} is not a tokenizer.json ({exc})") from None


def token_lengths(tokenizer, texts: list[str]) -> np.ndarray:
    """Tokens per text, special tokens included, without truncation or padding."""
    tokenizer.no_padding()
    tokenizer.no_truncation()
    return np.array([len(e.ids) for e in tokenizer.encode_batch(texts)], dtype=np.int64)


def choose_max_length(lengths: np.ndarray, quantile: float = 0.95, multiple: int = 8, cap: int = 512) -> int:
    """The sequence length that holds `quantile` of the texts whole, rounded up to `multiple`."""
    # The shortest length that `quantile` of the texts fit in (no interpolation past a real length).
    length = int(np.ceil(np.quantile(lengths, quantile, method="inverted_cdf") / multiple) * multiple)
    return max(multiple, min(cap, length))


def text_reference_stats(ids: np.ndarray, mask: np.ndarray, lengths: np.ndarray, unk: int | None) -> dict:
    """Text statistics beside the drift reference: token-length histogram and quantiles, unknown-token rate."""
    counts, _ = np.histogram(lengths, bins=LENGTH_BINS)
    real = mask.astype(bool)
    unknown = float(((ids == unk) & real).sum() / max(real.sum(), 1)) if unk is not None else 0.0
    return {
        "kind": "text",
        "token_length_bins": list(LENGTH_BINS),
        "token_length_histogram": (counts / max(len(lengths), 1)).round(6).tolist(),
        "token_length_quantiles": {str(q): float(np.quantile(lengths, q)) for q in (0.05, 0.25, 0.5, 0.75, 0.95, 0.99)},
        "unknown_token_id": unk,
        "unknown_token_rate": round(unknown, 6),
    }
