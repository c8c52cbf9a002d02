"""The prepared splits that `validate` writes and every later stage reads."""

from __future__ import annotations

import zipfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from pruneops.core.errors import DataError
from pruneops.core.inputs import rows
from pruneops.core.io import dump_json, read_json

SPLITS = ("train", "val", "test")


@dataclass(frozen=True)
class Split:
    """One split: inputs and int64 labels.

    Inputs are scaled to [0, 1] as float32 (images, tables), or named arrays (text: int64
    `input_ids` and `attention_mask`, one row per sample).
    """

    x: np.ndarray | dict[str, np.ndarray]
    y: np.ndarray

    def __len__(self) -> int:
        return len(self.y)

    def head(self, n: int) -> Split:
        """The first `n` samples."""
        return Split(rows(self.x, slice(0, n)), self.y[:n])

    @property
    def named(self) -> bool:
        """Whether the inputs are named arrays."""
        return isinstance(self.x, dict)


@dataclass(frozen=True)
class DataMeta:
    """What models need to know about the data."""

    dataset: str
    input_shape: list[int]
    num_classes: int
    classes: list[int]
    value_range: list[float]
    feature_names: list[str] | None = None
    class_names: list[str] | None = None  # label i's name (image folders: the class folder's name)
    inputs: list[dict] | None = None  # named inputs (`InputSpec.to_dict()`); None: one float input
    text: dict | None = None  # text data: tokenizer, max_length, what was dropped

    def save(self, path: Path) -> None:
        """Writes the metadata as JSON."""
        dump_json(asdict(self), path)


NAMED_PREFIX = "x."


def save_split(split: Split, path: Path) -> None:
    """Writes a split as an uncompressed NPZ (no pickles); named inputs as `x.<name>` entries."""
    if split.named:
        np.savez(path, y=split.y, **{f"{NAMED_PREFIX}{k}": v for k, v in split.x.items()})
    else:
        np.savez(path, x=split.x, y=split.y)


def load_split(data_dir: Path, name: str) -> Split:
    """Reads a prepared split written by the `validate` stage.

    Raises:
        DataError: The file is missing or unreadable.
    """
    path = Path(data_dir) / f"{name}.npz"
    try:
        with np.load(path, allow_pickle=False) as npz:
            if "x" in npz.files:
                return Split(npz["x"].astype(np.float32), npz["y"].astype(np.int64))
            named = {k[len(NAMED_PREFIX) :]: npz[k] for k in npz.files if k.startswith(NAMED_PREFIX)}
            if not named:
                raise KeyError("x")
            return Split(named, npz["y"].astype(np.int64))
    except FileNotFoundError:
        raise DataError(f"{path}: prepared split not found; run `pruneops validate` first") from None
    except (OSError, ValueError, KeyError, zipfile.BadZipFile, EOFError) as exc:
        why = f"{type(exc).__name__}: {exc}"
        raise DataError(f"{path}: cannot read prepared split ({why}); rerun `pruneops validate`") from None
    except MemoryError:
        why = "an array declares more data than memory holds"
        raise DataError(f"{path}: cannot read prepared split ({why}); rerun `pruneops validate`") from None


def load_meta(data_dir: Path) -> DataMeta:
    """Reads the metadata written beside the splits."""
    path = Path(data_dir) / "meta.json"
    try:
        return DataMeta(**read_json(path))
    except FileNotFoundError:
        raise DataError(f"{path}: not found; run `pruneops validate` first") from None
    except (ValueError, TypeError) as exc:
        raise DataError(f"{path}: unreadable metadata ({exc})") from None


def load_prepared(data_dir: Path) -> tuple[DataMeta, Split, Split, Split]:
    """Metadata and the train, val and test splits written by `validate`."""
    return (load_meta(data_dir), *(load_split(data_dir, s) for s in SPLITS))
