"""The served model: an ONNX Runtime session over `<registry>/production`, hot-reloaded."""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from pathlib import Path

from pruneops.modelstore.contract import contract_differences
from pruneops.modelstore.store import TOKENIZER, ModelRegistry, RegistryError, ServableModel, check_servable

log = logging.getLogger("pruneops.serving")


def load_version(path: Path, threads: int = 1) -> ServableModel:
    """Loads a registry version directory (model.onnx, metadata.json, reference statistics) and checks it runs.

    Raises:
        ValueError: The model cannot be loaded or does not run on its declared input shape.
    """
    path = Path(path).resolve()
    try:
        checked = check_servable(path, threads)
    except RegistryError as exc:
        raise ValueError(str(exc)) from None
    return dataclasses.replace(checked, encoder=_text_encoder(path, checked))


def _text_encoder(path: Path, checked) -> object | None:
    """The tokenizer of a text model (named int64 inputs and a registered tokenizer.json).

    Raises:
        ValueError: A text model without its tokenizer, or one that does not load.
    """
    text = checked.metadata.get("input", {}).get("text")
    if not text:
        return None
    tokenizer = path / TOKENIZER
    if not tokenizer.is_file():
        raise ValueError(f"{path}: a text model without its {TOKENIZER}")
    from pruneops.serving.text import TextEncoder

    try:
        names = [i.name for i in checked.session.get_inputs()]
        return TextEncoder(tokenizer, int(text["max_length"]), names)
    except Exception as exc:  # tokenizers raises a bare Exception for a malformed file
        raise ValueError(f"{tokenizer}: cannot load the tokenizer ({exc})") from None


class ModelHolder:
    """Holds the production model and swaps in a newly promoted one.

    Args:
        production: The registry's `production` symlink (or a version directory).
        threads: ONNX Runtime intra-op threads.
    """

    def __init__(self, production: Path, threads: int = 1):
        self.production = Path(production)
        self.threads = threads
        self.current: ServableModel | None = None
        self.reload_errors = 0
        # The production version that could not be served while an earlier one is (None otherwise).
        self.fallback_from: str | None = None
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
                self._check_contract(loaded)
            except ValueError as exc:
                self.reload_errors += 1
                log.error(
                    "refused new production model, still serving %s: %s",
                    self.current.version if self.current else "nothing",
                    exc,
                )
                return self.current is None and self._fall_back(Path(target).name)
            self.current, self.fallback_from = loaded, None
            log.info("serving model %s", loaded.version)
            return True

    def _check_contract(self, loaded: ServableModel) -> None:
        """Refuses a model that serves other requests than the served one, unless its promotion declared it.

        Raises:
            ValueError: The contracts differ and the registry's history does not declare the change.
        """
        if self.current is None:
            return
        differences = contract_differences(loaded.contract, self.current.contract)
        if not differences:
            return
        try:
            declared = ModelRegistry(self.production.parent).declared_contract_change(loaded.version)
        except RegistryError:
            declared = False
        if not declared:
            raise ValueError(f"it serves other requests than {self.current.version}: {'; '.join(differences)}")
        log.warning("serving contract changes with %s, as its promotion declared: %s", loaded.version, differences)

    def _fall_back(self, broken: str) -> bool:
        """With nothing served yet (a restart), serves the newest earlier production version that loads."""
        registry = ModelRegistry(self.production.parent)
        for version in reversed(registry.served_stack()):
            if version == broken:
                continue
            try:
                self.current = load_version(registry.get(version).path, self.threads)
            except (ValueError, RegistryError):
                continue
            self.fallback_from = broken
            log.error("production model %s cannot be served; serving the earlier version %s", broken, version)
            return True
        return False
