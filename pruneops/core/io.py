"""Where stages read and write, and how they write without leaving partial output behind."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Layout:
    """Paths of every stage's outputs under one project root.

    Args:
        root: The project directory (where `params.yaml` and `dvc.yaml` live).
    """

    root: Path = Path(".")

    def stage_dir(self, stage: str) -> Path:
        """Directory of a stage's artifacts (models, data, reports)."""
        return self.root / "artifacts" / stage

    def metrics(self, stage: str) -> Path:
        """The stage's metrics JSON, tracked by `dvc metrics`."""
        return self.root / "metrics" / f"{stage}.json"

    def plots(self, stage: str) -> Path:
        """Directory of the stage's plots (JSON for `dvc plots`, PNG for people)."""
        return self.root / "plots" / stage

    def state_dir(self) -> Path:
        """Local state that is neither code nor a stage output (locks, experiment worktrees, Prefect)."""
        return self.root / "state"


def _to_jsonable(obj: Any) -> Any:
    if hasattr(obj, "tolist"):
        return obj.tolist()
    if isinstance(obj, Path):
        return str(obj)
    raise TypeError(f"not JSON serializable: {type(obj).__name__}")


def dump_json(obj: Any, path: Path) -> None:
    """Writes `obj` as indented JSON (numpy values and paths converted)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(obj, indent=2, default=_to_jsonable) + "\n")


@contextmanager
def replaced_whole(path: Path) -> Iterator[Path]:
    """A file to write `path`'s new content to, which replaces `path` only once the block ends.

    A stop or an error while writing leaves `path` as it was (the last whole file) and no partial
    file beside it. The file keeps `path`'s suffix (`x.partial.npz` for `x.npz`), as writers that
    append one expect.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f"{path.stem}.partial{path.suffix}")
    try:
        yield partial
        os.replace(partial, path)
    finally:
        partial.unlink(missing_ok=True)


def read_json(path: Path) -> Any:
    """Reads a JSON file."""
    return json.loads(Path(path).read_text())


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    return True


def sweep_stale_twins(final: Path) -> list[Path]:
    """Removes temporary twins of `final` left by a stage that was killed (its process is gone).

    Returns:
        What was removed.
    """
    removed = []
    for twin in final.parent.glob(f".{final.name}.tmp-*"):
        pid = twin.name.removeprefix(f".{final.name}.tmp-").split("-", 1)[0]
        if not pid.isdigit() or not _alive(int(pid)):
            shutil.rmtree(twin, ignore_errors=True)
            removed.append(twin)
    return removed


class StagedOutputs:
    """Temporary twins of a stage's final outputs, swapped into place only on success.

    Each final path (file or directory) gets a temporary sibling named after this process, and
    twins left by a killed process are swept first. `path(final)` returns where to write;
    `commit()` replaces the finals by their twins; `discard()` removes the twins.
    """

    def __init__(self, finals: list[Path]):
        self._twins: dict[Path, Path] = {}
        for final in finals:
            final.parent.mkdir(parents=True, exist_ok=True)
            sweep_stale_twins(final)
            tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-{os.getpid()}-", dir=final.parent))
            self._twins[final] = tmp / final.name

    def path(self, final: Path) -> Path:
        """Where to write what will become `final`."""
        return self._twins[final]

    def dir(self, final: Path) -> Path:
        """Like `path`, and creates it as a directory."""
        twin = self._twins[final]
        twin.mkdir(parents=True, exist_ok=True)
        return twin

    def commit(self) -> None:
        """Moves every written twin onto its final path (each move is one rename)."""
        for final, twin in self._twins.items():
            if not twin.exists():
                continue
            if final.is_dir() and not final.is_symlink():
                shutil.rmtree(final)
            elif final.exists() or final.is_symlink():
                final.unlink()
            os.replace(twin, final)
        self.discard()

    def discard(self) -> None:
        """Removes the temporary twins (and anything written to them)."""
        for twin in self._twins.values():
            shutil.rmtree(twin.parent, ignore_errors=True)


@contextmanager
def staged_output_paths(*finals: Path) -> Iterator[StagedOutputs]:
    """Context manager over `StagedOutputs`: commits on success, discards on any error."""
    staged = StagedOutputs(list(finals))
    try:
        yield staged
    except BaseException:
        staged.discard()
        raise
    staged.commit()
