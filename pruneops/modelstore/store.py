"""A file-system model registry: versioned candidates, a promotion history and the production model.

Layout under `root` (default `models/`)::

    candidates/<version>/   model.onnx (+ .sha256), metadata.json (digest, data hash, params, metrics)
    history.json            every promotion and rollback, newest last: the source of truth
    production -> candidates/<version>   a symlink derived from the top of history (for serving)
    .lock                   held (flock) by every operation that writes

Every write (register, promote, rollback, recover) holds the lock across its read-modify-write;
history is replaced atomically (a per-process temporary file, fsync, rename) before the symlink
moves, and each operation first re-derives a symlink that lags history (a crash between the
two). Production is always the top of history. Promotion and rollback check their target the
same way (integrity, it loads and runs, its serving contract matches production's) before
anything moves.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pruneops.core import integrity
from pruneops.core.errors import PruneOpsError
from pruneops.core.integrity import IntegrityError, file_sha256, recorded_checksum, verify_file, write_checksum
from pruneops.core.io import Layout, dump_json, read_json
from pruneops.modelstore.contract import contract_differences
from pruneops.modelstore.decoder import (
    check_decoder_runs,
    decoder_contract,
    decoder_export,
    is_decoder_export,
    is_decoder_version,
)
from pruneops.runtimes.onnxruntime.contract import probe, serving_contract
from pruneops.runtimes.onnxruntime.files import INPUT_NAME

REFERENCE_STATS = "reference_stats.json"
TOKENIZER = "tokenizer.json"  # a text model's tokenizer, kept beside it: serving tokenises with it


def pipeline_model(layout: Layout) -> Path:
    """What the pipeline deploys: the pruned model in the precision the quantize stage chose."""
    return layout.stage_dir("export") / "pruned_deployed.onnx"


def pipeline_reference_stats(layout: Layout) -> Path:
    """The statistics of the data the pipeline's model was trained on (the drift reference)."""
    return layout.stage_dir("validate") / REFERENCE_STATS


class RegistryError(PruneOpsError):
    """The registry has no such version, nothing to roll back to, or a version that cannot serve."""


@dataclass(frozen=True)
class ServableModel:
    """A version checked to serve: its session, input shape, class count, metadata, drift reference.

    What promotion checks and what the server holds; requests keep a reference, so a swap never
    breaks one in flight.
    """

    path: Path
    session: object
    input_shape: tuple[int, ...]
    num_classes: int
    metadata: dict[str, Any]
    reference_stats: dict | None
    encoder: object | None = None  # a text model's `TextEncoder` (its tokenizer.json); None for arrays
    contract: dict[str, Any] | None = None  # `serving_contract`: what requests it serves

    @property
    def version(self) -> str:
        """The registry version (the directory's name)."""
        return self.path.name

    def predict_proba(self, x: np.ndarray | dict[str, np.ndarray]) -> np.ndarray:
        """Class probabilities for a batch (an array, or a text model's named feed)."""
        logits = self.session.run(None, x if isinstance(x, dict) else {INPUT_NAME: x})[0]
        z = logits - logits.max(axis=1, keepdims=True)
        e = np.exp(z)
        return e / e.sum(axis=1, keepdims=True)


def verify_version_files(path: Path) -> None:
    """Checks a version's files against the digests recorded when it was registered.

    A folder version (a decoder) file by file (`folder_manifest`: none changed, missing or added).

    Raises:
        RegistryError: No digest recorded, or the bytes differ.
    """
    try:
        metadata = read_json(path / "metadata.json")
    except (OSError, ValueError) as exc:
        raise RegistryError(f"{path / 'metadata.json'}: unreadable ({type(exc).__name__})") from None
    if not isinstance(metadata, dict):
        raise RegistryError(f"{path / 'metadata.json'}: not a JSON object")
    try:
        if "files_sha256" in metadata:  # a folder version (a decoder): every file, none added
            integrity.verify_manifest(path, metadata["files_sha256"], error=RegistryError)
            return
        verify_file(path / "model.onnx", metadata.get("sha256"), error=RegistryError)
        if (path / TOKENIZER).exists() or metadata.get("tokenizer_sha256"):
            verify_file(path / TOKENIZER, metadata.get("tokenizer_sha256"), error=RegistryError)
    except IntegrityError as exc:
        raise RegistryError(str(exc)) from None


def check_servable(path: Path, threads: int = 1) -> ServableModel:
    """Checks a version directory's digests, loads it in ONNX Runtime, runs one sample, reads its statistics.

    Raises:
        RegistryError: A digest mismatch; metadata, model or statistics unreadable; the model does
            not run on its declared input shape or gives other than finite (batch, classes) logits.
    """
    from pruneops.data.drift import parse_reference
    from pruneops.runtimes.onnxruntime.files import make_session

    path = Path(path)
    verify_version_files(path)
    try:
        metadata = read_json(path / "metadata.json")
        reference = read_json(path / REFERENCE_STATS) if (path / REFERENCE_STATS).exists() else None
        if is_decoder_version(metadata):
            session, vocab = check_decoder_runs(path)
            return ServableModel(path, session, (), vocab, metadata, reference, contract=decoder_contract(path))
        if reference is not None:
            parse_reference(reference)
        session = make_session(path / "model.onnx", threads)
        inputs = session.get_inputs()
        input_shape, _, out = probe(session, metadata)
    except Exception as exc:  # ONNX Runtime and a malformed JSON raise many types
        raise RegistryError(f"{path}: cannot serve this model ({type(exc).__name__}: {str(exc)[:200]})") from None
    if out.ndim != 2 or not np.isfinite(out).all():
        raise RegistryError(f"{path}: model output has shape {out.shape} or non-finite values, expected logits")
    contract = serving_contract(
        [(i.name, i.type, list(i.shape[1:])) for i in inputs],
        int(out.shape[1]),
        metadata,
        metadata.get("tokenizer_sha256"),
    )
    return ServableModel(path, session, input_shape, int(out.shape[1]), metadata, reference, contract=contract)


@dataclass(frozen=True)
class ModelVersion:
    """One registered model."""

    version: str
    path: Path
    metadata: dict[str, Any]

    @property
    def model_file(self) -> Path:
        """The ONNX model of this version."""
        return self.path / "model.onnx"


def git_revision(cwd: Path) -> str | None:
    """The checkout's commit, or None outside git."""
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=cwd, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def served_stack(history: list[dict[str, Any]]) -> list[str]:
    """Production versions as a stack: each promotion pushes, each rollback pops."""
    stack: list[str] = []
    for entry in history:
        if entry["action"] in ("promote", "recover"):
            stack.append(entry["version"])
        elif entry["action"] == "rollback" and stack:
            stack.pop()
    return stack


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _unique_tmp(directory: Path, stem: str) -> Path:
    """A temporary name no other process or thread uses."""
    return directory / f".{stem}.{os.getpid()}.{threading.get_ident()}.{uuid.uuid4().hex[:8]}.tmp"


class ModelRegistry:
    """Candidates, production and its history under one directory.

    Args:
        root: The registry directory (created on first use).
    """

    def __init__(self, root: Path):
        self.root = Path(root)
        self.candidates = self.root / "candidates"
        self.production_link = self.root / "production"
        self.history_file = self.root / "history.json"

    @contextlib.contextmanager
    def _locked(self) -> Iterator[None]:
        """Holds the registry's exclusive lock (processes and threads alike) for one operation."""
        self.root.mkdir(parents=True, exist_ok=True)
        with open(self.root / ".lock", "a+b") as handle:
            fcntl.flock(handle.fileno(), fcntl.LOCK_EX)
            try:
                yield
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def register(
        self,
        model_file: Path,
        metadata: dict[str, Any],
        version: str | None = None,
        reference_stats: Path | None = None,
        tokenizer: Path | None = None,
    ) -> ModelVersion:
        """Copies `model_file` in as a new candidate version (written aside, digests recorded, then renamed).

        Args:
            model_file: The ONNX model.
            metadata: Kept as `metadata.json` (data hash, params, metrics...).
            version: Version name; default: a timestamp.
            reference_stats: The training data's feature statistics (`reference_stats.json`), kept
                beside the model so that drift is measured against the data this model saw.
            tokenizer: A text model's `tokenizer.json`, kept beside it for serving.
        """
        version = version or time.strftime("v%Y%m%d-%H%M%S") + f"-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        with self._locked():
            final = self.candidates / version
            if final.exists():
                raise RegistryError(f"version {version!r} is already registered")
            tmp = _unique_tmp(self.candidates, version)
            tmp.mkdir(parents=True)
            try:
                if Path(model_file).is_dir():  # a decoder's export folder: weights, config, tokenizer, chat template
                    shutil.copytree(model_file, tmp, dirs_exist_ok=True)
                    digests = {}
                else:
                    shutil.copyfile(model_file, tmp / "model.onnx")
                    digests = {"sha256": write_checksum(tmp / "model.onnx")}
                if (tmp / TOKENIZER).is_file():  # a decoder folder brings its own
                    digests["tokenizer_sha256"] = file_sha256(tmp / TOKENIZER)
                if reference_stats is not None:
                    shutil.copyfile(reference_stats, tmp / REFERENCE_STATS)
                if tokenizer is not None:
                    shutil.copyfile(tokenizer, tmp / TOKENIZER)
                    digests["tokenizer_sha256"] = file_sha256(tmp / TOKENIZER)
                if Path(model_file).is_dir():  # every file of a folder version, checked wherever it is served
                    digests["files_sha256"] = integrity.folder_manifest(tmp)
                record = {"version": version, "registered_at": time.time(), **metadata, **digests}
                dump_json(record, tmp / "metadata.json")
                os.replace(tmp, final)
            except OSError as exc:
                shutil.rmtree(tmp, ignore_errors=True)
                raise RegistryError(f"cannot register {version!r}: {exc.strerror or exc}") from None
        return self.get(version)

    def register_pipeline_model(self, project: Path, metadata: dict[str, Any]) -> ModelVersion:
        """Registers what the pipeline in `project` deploys, with its drift reference statistics.

        Raises:
            RegistryError: The pipeline has not produced its model yet, or it changed since export.
        """
        layout = Layout(Path(project))
        if is_decoder_export(layout):
            folder, reference, extra = decoder_export(layout)
            return self.register(folder, {**metadata, **extra}, reference_stats=reference)
        model = pipeline_model(layout)
        if not model.is_file():
            raise RegistryError(f"{model}: no pipeline output to register; run `dvc repro` first")
        if recorded_checksum(model) is None:
            raise RegistryError(f"{model}: no recorded checksum; rerun `pruneops export` (or `dvc repro`)")
        verify_file(model, error=RegistryError)
        reference = pipeline_reference_stats(layout)
        tokenizer = layout.stage_dir("validate") / TOKENIZER
        return self.register(
            model,
            {**metadata, "input": pipeline_input_description(layout)},
            reference_stats=reference if reference.is_file() else None,
            tokenizer=tokenizer if tokenizer.is_file() else None,
        )

    def get(self, version: str) -> ModelVersion:
        """The registered `version`.

        Raises:
            RegistryError: No such version, or its metadata is unreadable.
        """
        path = self.candidates / version
        if not (path / "metadata.json").exists():
            raise RegistryError(f"no model version {version!r} in {self.candidates}")
        try:
            return ModelVersion(version, path, read_json(path / "metadata.json"))
        except (OSError, ValueError) as exc:
            raise RegistryError(f"{path / 'metadata.json'}: unreadable ({type(exc).__name__})") from None

    def versions(self) -> list[str]:
        """Registered versions whose metadata reads, oldest first."""
        if not self.candidates.exists():
            return []
        found = []
        for p in self.candidates.iterdir():
            if p.is_dir() and not p.name.startswith("."):
                with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
                    found.append((float(read_json(p / "metadata.json")["registered_at"]), p.name))
        return [name for _, name in sorted(found)]

    def history(self) -> list[dict[str, Any]]:
        """Promotions and rollbacks, oldest first.

        Raises:
            RegistryError: `history.json` is unreadable (`pruneops recover` rebuilds it).
        """
        if not self.history_file.exists():
            return []
        try:
            history = json.loads(self.history_file.read_text(encoding="utf-8"))
            if not isinstance(history, list) or not all(isinstance(e, dict) and "action" in e for e in history):
                raise ValueError("not a list of entries")
        except (OSError, ValueError) as exc:
            raise RegistryError(
                f"{self.history_file}: unreadable ({type(exc).__name__}); "
                "`pruneops recover` rebuilds a consistent registry from the candidates"
            ) from None
        return history

    def served_stack(self) -> list[str]:
        """Production versions as a stack: each promotion pushes, each rollback pops."""
        return served_stack(self.history())

    def production(self) -> ModelVersion | None:
        """The production model (the top of history), or None before the first promotion."""
        stack = self.served_stack()
        return self.get(stack[-1]) if stack else None

    def declared_contract_change(self, version: str) -> bool:
        """Whether the entry that made `version` production declared a change of serving contract."""
        history = self.history()
        for entry in reversed(history):
            if entry.get("version") == version and entry["action"] in ("promote", "rollback", "recover"):
                return bool(entry.get("contract_change"))
        return False

    def _write_history(self, history: list[dict[str, Any]]) -> None:
        tmp = _unique_tmp(self.root, "history")
        try:
            with open(tmp, "w", encoding="utf-8") as f:
                json.dump(history, f, indent=2)
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self.history_file)
            _fsync_dir(self.root)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise RegistryError(
                f"{self.history_file}: cannot write ({exc.strerror or exc}); production is unchanged"
            ) from None

    def _derive_production_link(self, history: list[dict[str, Any]]) -> None:
        """Points the symlink at the top of history (a new link beside it, then one rename)."""
        stack = served_stack(history)
        want = str(Path("candidates") / stack[-1]) if stack else None
        have = os.readlink(self.production_link) if self.production_link.is_symlink() else None
        if want == have:
            return
        if want is None:
            self.production_link.unlink(missing_ok=True)
            return
        tmp = _unique_tmp(self.root, "production")
        try:
            os.symlink(want, tmp)
            os.replace(tmp, self.production_link)
        except OSError as exc:
            with contextlib.suppress(OSError):
                tmp.unlink()
            raise RegistryError(
                f"{self.production_link}: cannot move ({exc.strerror or exc}); history says {stack[-1]}: "
                "the next registry operation moves it"
            ) from None

    def _commit(self, history: list[dict[str, Any]], entry: dict[str, Any]) -> None:
        """Appends `entry` durably, then moves the symlink to match."""
        self._write_history([*history, {"at": time.time(), **entry}])
        self._derive_production_link([*history, entry])

    def _checked_target(
        self, version: str, served: str | None, history: list, allow_contract_change: bool
    ) -> tuple[ModelVersion, dict[str, Any], bool]:
        """The target, checked to serve; its contract; whether that differs from the served one's.

        Raises:
            RegistryError: Unknown, corrupt or unservable; or a contract that differs from
                production's without `allow_contract_change`.
        """
        target = self.get(version)
        candidate = check_servable(target.path)
        if served is None or served == version:
            return target, candidate.contract, False
        current = self._contract_of(served, history)
        differences = contract_differences(candidate.contract, current) if current is not None else []
        if differences and not allow_contract_change:
            raise RegistryError(
                f"{version}: serves other requests than production {served} ({'; '.join(differences)}); "
                "nothing moved. Pass --allow-contract-change to make it production deliberately "
                "(the server then switches to it and clients must follow)"
            )
        return target, candidate.contract, bool(differences)

    def _contract_of(self, version: str, history: list) -> dict[str, Any] | None:
        """The contract recorded when `version` became production (checked again if none was)."""
        for entry in reversed(history):
            if entry.get("version") == version and entry.get("contract"):
                return entry["contract"]
        try:
            return check_servable(self.get(version).path).contract
        except RegistryError:
            return None  # production itself is broken: nothing to stay compatible with

    def promote(self, version: str, reason: str = "", *, allow_contract_change: bool = False) -> ModelVersion:
        """Makes `version` production once it is checked to serve, and records it.

        Raises:
            RegistryError: Unknown version; one that fails its digest, does not load and run
                (`check_servable`), or serves other requests than production (unless allowed).
        """
        with self._locked():
            history = self.history()
            self._derive_production_link(history)
            stack = served_stack(history)
            served = stack[-1] if stack else None
            target, contract, changed = self._checked_target(version, served, history, allow_contract_change)
            entry = {"action": "promote", "version": version, "previous": served, "reason": reason}
            self._commit(history, {**entry, "contract": contract, "contract_change": changed})
        return target

    def rollback(self, reason: str = "", *, allow_contract_change: bool = False) -> ModelVersion:
        """Restores the production model that preceded the current one, checked as promote checks.

        Raises:
            RegistryError: There is no earlier production model, or it cannot serve (nothing moves).
        """
        with self._locked():
            history = self.history()
            self._derive_production_link(history)
            stack = served_stack(history)
            if not stack:
                raise RegistryError("nothing is in production; nothing to roll back")
            if len(stack) < 2:
                raise RegistryError(f"{stack[-1]} is the first production model; nothing to roll back to")
            version = stack[-2]
            try:
                target, contract, changed = self._checked_target(version, stack[-1], history, allow_contract_change)
            except RegistryError as exc:
                raise RegistryError(f"cannot roll back to {version}: {exc}") from None
            entry = {"action": "rollback", "version": version, "previous": stack[-1], "reason": reason}
            self._commit(history, {**entry, "contract": contract, "contract_change": changed})
        return target

    def recover(self) -> dict[str, Any]:
        """Rebuilds a consistent registry: readable history, symlink at its top, no leftovers.

        An unreadable history is kept aside (`history.json.corrupt-<time>`) and replaced by one
        `recover` entry for the version the symlink pointed at when it still serves, else the
        newest version that does.

        Returns:
            What was done: `{"history", "production", "removed"}`.
        """
        with self._locked():
            removed = [p.name for p in self._sweep_leftovers()]
            try:
                history, rebuilt = self.history(), None
            except RegistryError:
                rebuilt = self.history_file.with_name(f"history.json.corrupt-{int(time.time())}")
                os.replace(self.history_file, rebuilt)
                history = self._rebuilt_history()
                self._write_history(history)
            self._derive_production_link(history)
            stack = served_stack(history)
        return {
            "history": f"rebuilt (the unreadable one kept as {rebuilt.name})" if rebuilt else "readable, kept",
            "production": stack[-1] if stack else None,
            "removed": removed,
        }

    def _sweep_leftovers(self) -> list[Path]:
        """Temporary files and half-registered versions of finished operations (called under the lock)."""
        leftovers = list(self.root.glob(".*.tmp")) + (
            list(self.candidates.glob(".*.tmp")) if self.candidates.exists() else []
        )
        for path in leftovers:
            shutil.rmtree(path) if path.is_dir() and not path.is_symlink() else path.unlink()
        return leftovers

    def _rebuilt_history(self) -> list[dict[str, Any]]:
        linked = Path(os.readlink(self.production_link)).name if self.production_link.is_symlink() else None
        candidates = ([linked] if linked else []) + list(reversed(self.versions()))
        for version in candidates:
            try:
                contract = check_servable(self.get(version).path).contract
            except RegistryError:
                continue
            reason = "recovered: history was unreadable"
            return [
                {"at": time.time(), "action": "recover", "version": version, "reason": reason, "contract": contract}
            ]
        return []


def registry_from_params(
    root: Path, params_file: str | Path = "params.yaml", override: str | None = None
) -> ModelRegistry:
    """The project's registry: `override` or `reprune.registry_dir`, relative to `root`."""
    if override is not None:
        return ModelRegistry(Path(root) / override)
    from pruneops.core.params import read_params
    from pruneops.pipeline.stages import load_configs

    reprune = load_configs(read_params(Path(root) / params_file), ("reprune",))["reprune"]
    return ModelRegistry(Path(root) / reprune.registry_dir)


def pipeline_input_description(layout: Layout) -> dict[str, Any]:
    """What serving needs to turn raw inputs into a feed.

    The data's shape, value range and class names, and for text its named inputs and tokenisation
    (`max_length`).
    """
    meta_path = layout.stage_dir("validate") / "meta.json"
    if not meta_path.is_file():
        return {}
    meta = read_json(meta_path)
    return {k: meta.get(k) for k in ("input_shape", "value_range", "class_names", "inputs", "text")}


def publish_pipeline_model(
    root: Path,
    params_file: str | Path = "params.yaml",
    registry_dir: str | None = None,
    *,
    force_promote: bool = False,
    allow_contract_change: bool = False,
    reason: str = "publish",
) -> dict[str, Any]:
    """Registers the pipeline's model of `root` and promotes it if nothing is in production.

    The metadata keeps the params, the benchmark metrics and the git revision.

    Returns:
        `{"version", "promoted", "path"}`.

    Raises:
        PruneOpsError: No pipeline output yet, or the params are invalid.
    """
    from pruneops.core.params import read_params

    root = Path(root)
    registry = registry_from_params(root, params_file, registry_dir)
    bench = Layout(root).metrics("benchmark")
    had_production = registry.production() is not None
    version = registry.register_pipeline_model(
        root,
        {
            "git_revision": git_revision(root),
            "reason": reason,
            "params": read_params(root / params_file),
            "metrics": read_json(bench) if bench.exists() else {},
        },
    )
    promoted = force_promote or not had_production
    if promoted:
        registry.promote(
            version.version,
            reason + (" (forced)" if had_production else " (first model)"),
            allow_contract_change=allow_contract_change,
        )
    return {"version": version.version, "promoted": promoted, "path": str(version.path)}
