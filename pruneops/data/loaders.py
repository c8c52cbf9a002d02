"""Raw data loaders, chosen by `validate.dataset`: `digits`, `npz`, `idx`, `image_folder`, `table`, `text`."""

from __future__ import annotations

import gzip
import zipfile
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from pruneops.config import ValidateConfig
from pruneops.core.errors import ConfigError, DataError
from pruneops.core.plugins import Registry
from pruneops.data.text import TextTable, describe_columns, read_text_table, refuse_duplicated_header


@dataclass(frozen=True)
class RawData:
    """Data as loaded, before checks and scaling.

    `x_test`/`y_test` are None when the source has no test split (one is then carved out).
    `table` holds the raw frame of tabular sources so the suite can check its schema.
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray | None
    y_test: np.ndarray | None
    input_shape: tuple[int, ...]
    value_range: tuple[float, float]
    feature_names: list[str] | None = None
    table: pd.DataFrame | None = None
    class_names: list[str] | None = None


LOADERS: Registry = Registry("dataset")
MAX_LABEL = 100_000  # a label beyond this is a corrupt file, not a class


def as_inputs(array: np.ndarray, where: str) -> np.ndarray:
    """Inputs as float32; anything but numbers is refused (never coerced to NaN silently).

    Raises:
        DataError: Non-numeric dtype.
    """
    if array.dtype.kind not in "buif":
        raise DataError(f"{where}: inputs must be numbers, got dtype {array.dtype}")
    with np.errstate(over="ignore", invalid="ignore"):  # out-of-range values become inf: the suite reports them
        return array.astype(np.float32)


def as_labels(array: np.ndarray, where: str) -> np.ndarray:
    """Labels as int64: integers (or integral floats) in [0, MAX_LABEL); anything else is refused.

    Raises:
        DataError: Not one label per sample, not integral, negative or absurdly large.
    """
    if array.ndim != 1:
        raise DataError(f"{where}: labels must be one integer per sample, got shape {list(array.shape)}")
    if array.dtype.kind == "f":
        bad = ~np.isfinite(array) | (array != np.round(array))
        if bad.any():
            raise DataError(f"{where}: labels must be integers, found {array[bad][:3].tolist()}")
    elif array.dtype.kind not in "iu":
        raise DataError(f"{where}: labels must be integers, got dtype {array.dtype}")
    out_of_range = (array < 0) | (array >= MAX_LABEL)
    if out_of_range.any():
        raise DataError(f"{where}: labels must be in 0..{MAX_LABEL - 1}, found {array[out_of_range][:3].tolist()}")
    return array.astype(np.int64)


def _require_path(config: ValidateConfig) -> Path:
    if not config.path:
        raise ConfigError(f"validate.path: required for dataset {config.dataset!r}")
    path = Path(config.path)
    if not path.is_file():
        raise DataError(f"{path}: data file not found")
    return path


@LOADERS.register("digits", "scikit-learn's bundled 8x8 digits (1,797 images, no download)")
def load_digits(config: ValidateConfig) -> RawData:
    """scikit-learn's bundled 8x8 digits."""
    from sklearn.datasets import load_digits as sk_digits

    bunch = sk_digits()
    x = bunch.images.astype(np.float32)[:, None, :, :]
    return RawData(x, bunch.target.astype(np.int64), None, None, (1, 8, 8), (0.0, 16.0))


@LOADERS.register("npz", "NPZ with x_train, y_train, x_test, y_test (e.g. MNIST)")
def load_npz(config: ValidateConfig) -> RawData:
    """NPZ archive with `x_train, y_train, x_test, y_test`; images get a channel axis."""
    path = _require_path(config)
    try:
        with np.load(path, allow_pickle=False) as npz:
            missing = {"x_train", "y_train", "x_test", "y_test"} - set(npz.files)
            if missing:
                raise DataError(f"{path}: missing arrays {sorted(missing)}; found {npz.files}")
            arrays = {k: npz[k] for k in ("x_train", "y_train", "x_test", "y_test")}
    except (OSError, ValueError, zipfile.BadZipFile, EOFError) as exc:
        raise DataError(f"{path}: not a readable NPZ archive ({exc})") from None
    except MemoryError:
        raise DataError(f"{path}: an array declares more data than memory holds (a corrupt NPZ?)") from None
    xtr, xte = arrays["x_train"], arrays["x_test"]
    if any(a.ndim == 0 for a in arrays.values()):
        raise DataError(f"{path}: arrays must hold one entry per sample, found a scalar; {_shapes(arrays)}")
    if xtr.ndim == 3:  # (N, H, W) grey images -> (N, 1, H, W)
        xtr, xte = xtr[:, None], xte[:, None]
    if (
        xtr.ndim < 2
        or xtr.shape[1:] != xte.shape[1:]
        or len(xtr) != len(arrays["y_train"])
        or len(xte) != len(arrays["y_test"])
        or not len(xtr)
        or not len(xte)
    ):
        raise DataError(f"{path}: inconsistent shapes; {_shapes(arrays)}")
    default_range = (0.0, 255.0) if xtr.dtype == np.uint8 else (0.0, 1.0)
    return RawData(
        as_inputs(xtr, f"{path}: x_train"),
        as_labels(arrays["y_train"], f"{path}: y_train"),
        as_inputs(xte, f"{path}: x_test"),
        as_labels(arrays["y_test"], f"{path}: y_test"),
        tuple(int(d) for d in xtr.shape[1:]),
        default_range,
    )


# IDX (LeCun's MNIST format): type code -> big-endian dtype.
IDX_DTYPES = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}
IDX_MAX_BYTES = 4 << 30  # a header that promises more than this is a corrupt file, not data
IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}


def read_idx(path: Path) -> np.ndarray:
    """One IDX file (plain or `.gz`) as an array in native byte order.

    The header is read first and the size it promises checked before the body is read, so a
    corrupt header cannot make the loader allocate or decompress without bound.

    Raises:
        DataError: Not IDX, an unknown type code, or a body shorter or longer than the header says.
    """
    opener = gzip.open if path.suffix == ".gz" else open
    try:
        with opener(path, "rb") as f:
            head = f.read(4)
            if len(head) < 4 or head[:2] != b"\0\0" or head[2] not in IDX_DTYPES or not 1 <= head[3] <= 4:
                raise DataError(f"{path}: not an IDX file (magic {head.hex() or 'empty'})")
            dims_raw = f.read(4 * head[3])
            if len(dims_raw) < 4 * head[3]:
                raise DataError(f"{path}: truncated IDX header")
            dims = [int(d) for d in np.frombuffer(dims_raw, ">u4")]
            dtype = np.dtype(IDX_DTYPES[head[2]])
            size = int(np.prod(dims, dtype=np.int64)) * dtype.itemsize
            if size > IDX_MAX_BYTES or not all(dims):
                raise DataError(f"{path}: IDX header gives shape {dims}: empty or implausibly large")
            body = f.read(size + 1)
    except (OSError, EOFError, zlib.error) as exc:
        raise DataError(f"{path}: unreadable ({exc})") from None
    if len(body) != size:
        raise DataError(f"{path}: IDX body has {len(body)} bytes{'+' if len(body) > size else ''}, header says {size}")
    return np.frombuffer(body, dtype).reshape(dims).astype(dtype.newbyteorder("="))


def _idx_file(folder: Path, stem: str) -> Path:
    for name in (stem, f"{stem}.gz"):
        if (folder / name).is_file():
            return folder / name
    raise DataError(f"{folder}: {stem}[.gz] not found (an IDX folder holds {', '.join(IDX_FILES.values())})")


@LOADERS.register("idx", "IDX files as MNIST/Fashion-MNIST ship them (plain or .gz) in a folder")
def load_idx(config: ValidateConfig) -> RawData:
    """A folder of `train-images-idx3-ubyte[.gz]`, `train-labels-idx1-ubyte[.gz]` and the `t10k-` pair."""
    if not config.path:
        raise ConfigError("validate.path: required for dataset 'idx' (the folder of the IDX files)")
    folder = Path(config.path)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder (dataset 'idx' reads the four IDX files in one)")
    arrays = {key: read_idx(_idx_file(folder, stem)) for key, stem in IDX_FILES.items()}
    xtr, xte = arrays["x_train"], arrays["x_test"]
    if (
        xtr.ndim != 3
        or xte.shape[1:] != xtr.shape[1:]
        or len(xtr) != len(arrays["y_train"])
        or len(xte) != len(arrays["y_test"])
    ):
        raise DataError(f"{folder}: inconsistent IDX shapes; {_shapes(arrays)}")
    default_range = (0.0, 255.0) if xtr.dtype == np.uint8 else (float(xtr.min()), float(xtr.max()))
    return RawData(
        as_inputs(xtr[:, None], f"{folder}: {IDX_FILES['x_train']}"),
        as_labels(arrays["y_train"], f"{folder}: {IDX_FILES['y_train']}"),
        as_inputs(xte[:, None], f"{folder}: {IDX_FILES['x_test']}"),
        as_labels(arrays["y_test"], f"{folder}: {IDX_FILES['y_test']}"),
        (1, *(int(d) for d in xtr.shape[1:])),
        default_range,
    )


IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")
MAX_IMAGE_PIXELS = 4096 * 4096  # one image beyond this is a mistake (or a decompression bomb), not data
MAX_IMAGES = 2_000_000


def _image_files(folder: Path) -> dict[str, list[Path]]:
    """Per class folder (sorted by name), its image files (sorted); hidden files are skipped.

    Raises:
        DataError: No class folders, an empty class, or a file that is not PNG/JPEG.
    """
    classes = sorted(d for d in folder.iterdir() if d.is_dir() and not d.name.startswith("."))
    if not classes:
        raise DataError(f"{folder}: no class folders (image_folder wants <folder>/<class>/<image>.png|jpg)")
    files = {}
    for d in classes:
        entries = sorted(f for f in d.iterdir() if not f.name.startswith("."))
        other = [f.name for f in entries if f.suffix.lower() not in IMAGE_SUFFIXES]
        if other:
            raise DataError(f"{d}: not PNG/JPEG: {', '.join(other[:3])}{' ...' if len(other) > 3 else ''}")
        if not entries:
            raise DataError(f"{d}: class folder has no images")
        files[d.name] = entries
    return files


def _read_image(path: Path, mode: str | None) -> np.ndarray:
    """One image as an (H, W) or (H, W, 3) uint8 array, in `mode` ("L" or "RGB"; None: from the file)."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as img:
            if img.width * img.height > MAX_IMAGE_PIXELS:
                raise DataError(f"{path}: {img.width}x{img.height} is larger than {MAX_IMAGE_PIXELS} pixels")
            target = mode or ("L" if img.mode in ("1", "L", "I;16", "I") else "RGB")
            return np.asarray(img.convert(target), dtype=np.uint8)
    except Image.DecompressionBombError:  # Pillow refuses huge headers itself, before our own bound
        raise DataError(f"{path}: larger than {MAX_IMAGE_PIXELS} pixels") from None
    except (UnidentifiedImageError, OSError, SyntaxError, ValueError) as exc:
        raise DataError(f"{path}: unreadable image ({exc})") from None


def _load_image_split(folder: Path, class_names: list[str] | None, mode: str | None):
    """Images and labels of one split folder; the class order is `class_names` (or this folder's)."""
    files = _image_files(folder)
    names = class_names or list(files)
    unknown = [c for c in files if c not in names]
    if unknown:
        raise DataError(f"{folder}: classes not in the training folder: {', '.join(unknown[:5])}")
    if sum(len(v) for v in files.values()) > MAX_IMAGES:
        raise DataError(f"{folder}: more than {MAX_IMAGES} images")
    images, labels = [], []
    for name, paths in files.items():
        for path in paths:
            image = _read_image(path, mode)
            mode = mode or ("L" if image.ndim == 2 else "RGB")
            if images and image.shape != images[0].shape:
                raise DataError(
                    f"{path}: {image.shape[1]}x{image.shape[0]} image, the first was "
                    f"{images[0].shape[1]}x{images[0].shape[0]} (every image must have one size)"
                )
            images.append(image)
            labels.append(names.index(name))
    x = np.stack(images)
    x = x[:, None] if x.ndim == 3 else x.transpose(0, 3, 1, 2)  # to (N, C, H, W)
    return x, np.array(labels, dtype=np.int64), names, mode


@LOADERS.register("image_folder", "PNG/JPEG images, one folder per class (<path>/train, <path>/test, or <path>)")
def load_image_folder(config: ValidateConfig) -> RawData:
    """`<path>/train/<class>/*` and `<path>/test/<class>/*`, or `<path>/<class>/*` with no test split.

    Classes are the folder names in sorted order (label 0 is the first); a grayscale first image
    makes every image 1-channel, any other mode 3-channel RGB. Every image must have one size.
    """
    if not config.path:
        raise ConfigError("validate.path: required for dataset 'image_folder' (the folder of class folders)")
    folder = Path(config.path)
    if not folder.is_dir():
        raise DataError(f"{folder}: not a folder (dataset 'image_folder' reads <path>/<class>/<image>)")
    split = (folder / "train").is_dir()
    x, y, names, mode = _load_image_split(folder / "train" if split else folder, None, None)
    x_test = y_test = None
    if split and (folder / "test").is_dir():
        x_test, y_test, _, _ = _load_image_split(folder / "test", names, mode)
        if x_test.shape[1:] != x.shape[1:]:
            raise DataError(f"{folder}/test: images are {list(x_test.shape[1:])}, training ones {list(x.shape[1:])}")
    return RawData(
        as_inputs(x, str(folder)),
        y,
        None if x_test is None else as_inputs(x_test, f"{folder}/test"),
        y_test,
        tuple(int(d) for d in x.shape[1:]),
        (0.0, 255.0),
        class_names=names,
    )


def _shapes(arrays: dict[str, np.ndarray]) -> str:
    return ", ".join(f"{k} {tuple(v.shape)}" for k, v in arrays.items())


@LOADERS.register("table", "CSV or Parquet: feature columns + a label column")
def load_table(config: ValidateConfig) -> RawData:
    """CSV/Parquet table: `feature_columns` (default: all but the label) and `label_column`."""
    path = _require_path(config)
    try:
        if path.suffix.lower() in (".parquet", ".pq"):
            frame = pd.read_parquet(path)
        else:
            refuse_duplicated_header(path)
            frame = pd.read_csv(path)
        frame.columns = [str(c) for c in frame.columns]
    except DataError:
        raise
    except Exception as exc:  # pandas raises many unrelated types for unreadable files
        raise DataError(f"{path}: cannot read table ({type(exc).__name__}: {exc})") from None
    if config.label_column not in frame.columns:
        raise DataError(f"{path}: label column {config.label_column!r} not found; {describe_columns(frame.columns)}")
    features = config.feature_columns or [str(c) for c in frame.columns if c != config.label_column]
    present = [c for c in features if c in frame.columns]
    if not present or len(frame) < 2:
        raise DataError(f"{path}: needs feature columns and at least 2 rows; {describe_columns(frame.columns)}")
    numeric = frame[present].apply(pd.to_numeric, errors="coerce")
    _refuse_text(frame[present], numeric, path)
    x = as_inputs(numeric.to_numpy(dtype=np.float64), f"{path}: features")
    labels = pd.to_numeric(frame[config.label_column], errors="coerce")
    _refuse_text(frame[[config.label_column]], labels.to_frame(), path)
    y = as_labels(labels.dropna().to_numpy(), f"{path}: column {config.label_column!r}")
    if len(y) != len(frame):
        raise DataError(f"{path}: column {config.label_column!r} has {len(frame) - len(y)} empty labels")
    finite = x[np.isfinite(x)]
    default_range = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 1.0)
    if default_range[0] == default_range[1]:
        default_range = (default_range[0], default_range[0] + 1.0)
    return RawData(x, y, None, None, (len(features),), default_range, feature_names=features, table=frame)


def _refuse_text(raw: pd.DataFrame, numeric: pd.DataFrame, path: Path) -> None:
    """A value that was there but is not a number is an error, not a NaN.

    Raises:
        DataError: Names the first such column and a value.
    """
    for column in raw.columns:
        lost = raw[column].notna() & numeric[column].isna()
        if lost.any():
            raise DataError(
                f"{path}: column {column!r} has non-numeric values, e.g. {raw[column][lost].iloc[0]!r} "
                "(this loader takes numeric tables)"
            )


@LOADERS.register("text", "labelled sentences: CSV/TSV/JSONL/Parquet (plain, .gz, .bz2), tokenised by tokenizer.json")
def load_text(config: ValidateConfig) -> TextTable:
    """`text_column` and `label_column` of a table (labels strings or integers), in `encoding`."""
    return read_text_table(
        _require_path(config), config.text_column, config.label_column, config.encoding, config.exclude_labels
    )


def load_raw(config: ValidateConfig) -> RawData | TextTable:
    """Loads the dataset named by `config.dataset`."""
    return LOADERS.get(config.dataset)(config)
