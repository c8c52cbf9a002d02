"""The served model: an ONNX Runtime session over `<registry>/production`, hot-reloaded."""

from __future__ import annotations

import logging
import os
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pruneops.drift import DriftMonitor
from pruneops.io import read_json
from pruneops.model_registry import REFERENCE_STATS
from pruneops.onnx_utils import INPUT_NAME, make_session

log = logging.getLogger("pruneops.serving")


@dataclass(frozen=True)
class LoadedModel:
    """One loaded version; requests keep a reference, so a swap never breaks one in flight."""

    version: str
    session: object
    input_shape: tuple[int, ...]
    metadata: dict
    reference_stats: dict | None = None
    num_classes: int | None = None

    def predict_proba(self, x: np.ndarray) -> np.ndarray:
        """Class probabilities for a batch."""
        logits = self.session.run(None, {INPUT_NAME: x})[0]
        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


def load_version(path: Path, threads: int = 1) -> LoadedModel:
    """Loads a registry version directory (model.onnx, metadata.json, reference statistics) and checks it runs.

    Raises:
        ValueError: The model cannot be loaded or does not run on its declared input shape.
    """
    path = path.resolve()
    try:
        metadata = read_json(path / "metadata.json")
        reference = read_json(path / REFERENCE_STATS) if (path / REFERENCE_STATS).exists() else None
        if reference is not None:
            DriftMonitor(reference)  # malformed statistics refuse the version, before any swap
        session = make_session(path / "model.onnx", threads)
        dims = session.get_inputs()[0].shape[1:]
        input_shape = tuple(int(d) for d in dims)
        out = session.run(None, {INPUT_NAME: np.zeros((1, *input_shape), dtype=np.float32)})[0]
    except Exception as exc:  # onnxruntime and a malformed JSON raise many types
        raise ValueError(f"{path}: cannot serve this model ({type(exc).__name__}: {exc})") from None
    if out.ndim != 2 or not np.isfinite(out).all():
        raise ValueError(f"{path}: model output has shape {out.shape} or non-finite values, expected finite logits")
    return LoadedModel(path.name, session, input_shape, metadata, reference, int(out.shape[1]))


class ModelHolder:
    """Holds the production model and swaps in a newly promoted one.

    Args:
        production: The registry's `production` symlink (or a version directory).
        threads: ONNX Runtime intra-op threads.
    """

    def __init__(self, production: Path, threads: int = 1):
        self.production = Path(production)
        self.threads = threads
        self.current: LoadedModel | None = None
        self.reload_errors = 0
        self._target: str | None = None
        self._lock = threading.Lock()

    def _resolved(self) -> str | None:
        try:
            return os.path.realpath(self.production) if self.production.exists() else None
        except OSError:
            return None

    def refresh(self) -> bool:
        """Loads production if it changed; a model that fails to load is refused (old one stays).

        Returns:
            True when a new model was swapped in.
        """
        with self._lock:
            target = self._resolved()
            if target is None or target == self._target:
                return False
            self._target = target
            try:
                loaded = load_version(Path(target), self.threads)
                if self.current is not None and loaded.input_shape != self.current.input_shape:
                    raise ValueError(
                        f"input shape {loaded.input_shape} differs from the served {self.current.input_shape}"
                    )
            except ValueError as exc:
                self.reload_errors += 1
                log.error(
                    "refused new production model, still serving %s: %s",
                    self.current.version if self.current else "nothing",
                    exc,
                )
                return False
            self.current = loaded
            log.info("serving model %s", loaded.version)
            return True
