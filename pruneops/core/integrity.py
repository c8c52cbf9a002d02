"""SHA-256 checksums of the files a stage writes and a later step trusts.

The stage that writes a file records its digest beside it (`<file>.sha256`, the `sha256sum`
format); whatever reads the file later (a stage, `publish`, promotion, serving) checks it first,
so that a file changed on disk after it was written (bit rot, a half copy, an edit) is refused
with one line naming it instead of being benchmarked, published or served.

An ONNX model's external weights (`<file>.data`, torch.onnx's name for them) are covered by the
same digest.
"""

from __future__ import annotations

import hashlib
from pathlib import Path

from pruneops.core.errors import PruneOpsError


class IntegrityError(PruneOpsError):
    """A file's bytes differ from the digest recorded when it was written, or none was recorded."""


def _companions(path: Path) -> list[Path]:
    """The file and, where present, its ONNX external data."""
    data = Path(f"{path}.data")
    return [path, data] if data.is_file() else [path]


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file's bytes (and its ONNX external data, where present), hex."""
    digest = hashlib.sha256()
    for part in _companions(Path(path)):
        _read_into(digest, part)
    return digest.hexdigest()


def _read_into(digest: object, path: Path) -> None:
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)


def checksum_path(path: Path) -> Path:
    """Where a file's SHA-256 is kept."""
    return Path(f"{path}.sha256")


def write_checksum(path: Path) -> str:
    """Records the SHA-256 of `path` beside it; returns the digest."""
    digest = file_sha256(path)
    checksum_path(path).write_text(f"{digest}  {Path(path).name}\n")
    return digest


def recorded_checksum(path: Path) -> str | None:
    """The digest recorded beside `path`, or None when there is none (or it is not one)."""
    recorded = checksum_path(path)
    try:
        fields = recorded.read_text(encoding="ascii", errors="replace")[:200].split()
    except OSError:
        return None
    digest = fields[0] if fields else ""
    return digest if len(digest) == 64 and all(c in "0123456789abcdef" for c in digest) else None


def verify_file(path: Path, expected: str | None = None, error: type[PruneOpsError] = IntegrityError) -> str:
    """Checks `path` against `expected`, or against the digest recorded beside it.

    Returns:
        The file's digest.

    Raises:
        PruneOpsError: (`error`) No digest recorded, or the bytes differ from it.
    """
    path = Path(path)
    expected = expected or recorded_checksum(path)
    if expected is None:
        raise error(f"{path}: no recorded checksum ({checksum_path(path).name}); rerun the stage that wrote it")
    if not path.is_file():
        raise error(f"{path}: missing; rerun the stage that wrote it")
    actual = file_sha256(path)
    if actual != expected:
        raise error(_mismatch(path, expected, actual, "the file changed after it was written (corrupt or edited); "
                              "rerun the stage that wrote it"))  # fmt: skip
    return actual


def _mismatch(path: Path, expected: str, actual: str, why: str) -> str:
    return f"{path}: checksum mismatch (recorded {str(expected)[:12]}…, file {actual[:12]}…): {why}"


MANIFEST_EXCLUDED = ("metadata.json",)  # where the manifest itself is kept


def folder_manifest(folder: Path) -> dict[str, str]:
    """The SHA-256 of every file under `folder` (its relative path to digest), the manifest's own file aside."""
    folder = Path(folder)
    return {name: _bytes_sha256(folder / name) for name in sorted(_files(folder) - set(MANIFEST_EXCLUDED))}


def _files(folder: Path) -> set[str]:
    """Every file under `folder`, as its path relative to it."""
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*") if p.is_file()}


def _bytes_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    _read_into(digest, path)
    return digest.hexdigest()


def verify_manifest(folder: Path, manifest: dict[str, str], error: type[PruneOpsError] = IntegrityError) -> None:
    """Checks every file of `folder` against `manifest`: none missing, none changed, none added.

    Raises:
        PruneOpsError: (`error`) naming the first file that differs (a model, config, tokenizer or
            chat template changed, missing or added after the manifest was recorded).
    """
    folder = Path(folder)
    if not isinstance(manifest, dict) or not manifest:
        raise error(f"{folder}: no file digests recorded; register it again")
    added = sorted(_files(folder) - set(manifest) - set(MANIFEST_EXCLUDED))
    if added:
        raise error(f"{folder / added[0]}: not among the files recorded when the version was registered")
    for name, expected in manifest.items():
        path = folder / name
        if not path.is_file():
            raise error(f"{path}: missing (recorded when the version was registered)")
        actual = _bytes_sha256(path)
        if actual != expected:
            why = "changed after the version was registered (corrupt or edited)"
            raise error(_mismatch(path, expected, actual, why))
