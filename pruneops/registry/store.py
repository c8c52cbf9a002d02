"""A file-system model registry: versioned candidates and an atomically swapped production model.

Layout under `root` (default `models/`)::

    candidates/<version>/   model.onnx, metadata.json (data hash, params, metrics, git revision)
    production -> candidates/<version>   (a symlink, swapped with one rename)
    history.json            every promotion, newest last (what `rollback` walks back)
"""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from pruneops.errors import PruneOpsError
from pruneops.io import Layout, dump_json, read_json
from pruneops.onnx_utils import INPUT_NAME

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


def check_servable(path: Path, threads: int = 1) -> ServableModel:
    """Loads a version directory in ONNX Runtime, runs one sample and checks its reference statistics.

    Raises:
        RegistryError: Metadata, model or statistics unreadable; the model does not run on its
            declared input shape or gives other than finite (batch, classes) logits.
    """
    from pruneops.drift import parse_reference
    from pruneops.onnx_utils import make_session

    path = Path(path)
    try:
        metadata = read_json(path / "metadata.json")
        reference = read_json(path / REFERENCE_STATS) if (path / REFERENCE_STATS).exists() else None
        if reference is not None:
            parse_reference(reference)
        session = make_session(path / "model.onnx", threads)
        inputs = session.get_inputs()
        if len(inputs) == 1:
            input_shape = tuple(int(d) for d in inputs[0].shape[1:])
            feed = {INPUT_NAME: np.zeros((1, *input_shape), dtype=np.float32)}
        else:  # named text inputs: one example of the data's max_length
            input_shape = tuple(metadata.get("input", {}).get("input_shape") or [8])
            feed = {i.name: np.ones((1, *input_shape), dtype=np.int64) for i in inputs}
        out = session.run(None, feed)[0]
    except Exception as exc:  # ONNX Runtime and a malformed JSON raise many types
        raise RegistryError(f"{path}: cannot serve this model ({type(exc).__name__}: {exc})") from None
    if out.ndim != 2 or not np.isfinite(out).all():
        raise RegistryError(f"{path}: model output has shape {out.shape} or non-finite values, expected logits")
    return ServableModel(path, session, input_shape, int(out.shape[1]), metadata, reference)


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

    def register(
        self,
        model_file: Path,
        metadata: dict[str, Any],
        version: str | None = None,
        reference_stats: Path | None = None,
        tokenizer: Path | None = None,
    ) -> ModelVersion:
        """Copies `model_file` in as a new candidate version (written aside, then renamed).

        Args:
            model_file: The ONNX model.
            metadata: Kept as `metadata.json` (data hash, params, metrics...).
            version: Version name; default: a timestamp.
            reference_stats: The training data's feature statistics (`reference_stats.json`), kept
                beside the model so that drift is measured against the data this model saw.
            tokenizer: A text model's `tokenizer.json`, kept beside it for serving.
        """
        version = version or time.strftime("v%Y%m%d-%H%M%S") + f"-{os.getpid()}-{time.monotonic_ns() % 10**6}"
        final = self.candidates / version
        if final.exists():
            raise RegistryError(f"version {version!r} is already registered")
        tmp = self.candidates / f".{version}.tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        shutil.copyfile(model_file, tmp / "model.onnx")
        if reference_stats is not None:
            shutil.copyfile(reference_stats, tmp / REFERENCE_STATS)
        if tokenizer is not None:
            shutil.copyfile(tokenizer, tmp / TOKENIZER)
        dump_json({"version": version, "registered_at": time.time(), **metadata}, tmp / "metadata.json")
        os.replace(tmp, final)
        return self.get(version)

    def register_pipeline_model(self, project: Path, metadata: dict[str, Any]) -> ModelVersion:
        """Registers what the pipeline in `project` deploys, with its drift reference statistics.

        Raises:
            RegistryError: The pipeline has not produced its model yet.
        """
        layout = Layout(Path(project))
        model = pipeline_model(layout)
        if not model.is_file():
            raise RegistryError(f"{model}: no pipeline output to register; run `dvc repro` first")
        reference = pipeline_reference_stats(layout)
        tokenizer = layout.stage_dir("validate") / TOKENIZER
        return self.register(
            model,
            {**metadata, "input": pipeline_input_description(layout)},
            reference_stats=reference if reference.is_file() else None,
            tokenizer=tokenizer if tokenizer.is_file() else None,
        )

    def get(self, version: str) -> ModelVersion:
        """The registered `version`."""
        path = self.candidates / version
        if not (path / "metadata.json").exists():
            raise RegistryError(f"no model version {version!r} in {self.candidates}")
        return ModelVersion(version, path, read_json(path / "metadata.json"))

    def versions(self) -> list[str]:
        """Registered versions, oldest first."""
        if not self.candidates.exists():
            return []
        found = [p for p in self.candidates.iterdir() if p.is_dir() and not p.name.startswith(".")]
        return [p.name for p in sorted(found, key=lambda p: read_json(p / "metadata.json")["registered_at"])]

    def production(self) -> ModelVersion | None:
        """The production model, or None before the first promotion."""
        if not self.production_link.is_symlink():
            return None
        return self.get(Path(os.readlink(self.production_link)).name)

    def history(self) -> list[dict[str, Any]]:
        """Promotions, oldest first."""
        return read_json(self.history_file) if self.history_file.exists() else []

    def _point_production_at(self, version: str) -> None:
        # A new symlink beside the old one, then one rename: readers see the old or the new.
        tmp = self.root / f".production.{os.getpid()}.tmp"
        if tmp.is_symlink() or tmp.exists():
            tmp.unlink()
        os.symlink(Path("candidates") / version, tmp)
        os.replace(tmp, self.production_link)

    def _record(self, entry: dict[str, Any]) -> None:
        history = self.history()
        history.append({"at": time.time(), **entry})
        tmp = self.history_file.with_suffix(".tmp")
        dump_json(history, tmp)
        os.replace(tmp, self.history_file)

    def promote(self, version: str, reason: str = "") -> ModelVersion:
        """Makes `version` production (atomically) and records it, once it is checked to serve.

        Raises:
            RegistryError: Unknown version, or one that does not load and run (`check_servable`).
        """
        target = self.get(version)
        check_servable(target.path)
        previous = self.production()
        self._point_production_at(version)
        self._record(
            {
                "action": "promote",
                "version": version,
                "previous": previous.version if previous else None,
                "reason": reason,
            }
        )
        return target

    def served_stack(self) -> list[str]:
        """Production versions as a stack: each promotion pushes, each rollback pops."""
        stack: list[str] = []
        for entry in self.history():
            if entry["action"] == "promote":
                stack.append(entry["version"])
            elif entry["action"] == "rollback" and stack:
                stack.pop()
        return stack

    def rollback(self) -> ModelVersion:
        """Restores the production model that preceded the current one.

        Raises:
            RegistryError: There is no earlier production model.
        """
        stack = self.served_stack()
        if not stack:
            raise RegistryError("nothing is in production; nothing to roll back")
        if len(stack) < 2:
            raise RegistryError(f"{stack[-1]} is the first production model; nothing to roll back to")
        version = stack[-2]
        self._point_production_at(version)
        self._record({"action": "rollback", "version": version, "previous": stack[-1]})
        return self.get(version)


def registry_from_params(
    root: Path, params_file: str | Path = "params.yaml", override: str | None = None
) -> ModelRegistry:
    """The project's registry: `override` or `reprune.registry_dir`, relative to `root`."""
    if override is not None:
        return ModelRegistry(Path(root) / override)
    from pruneops.params import read_params
    from pruneops.stages import load_configs

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
    reason: str = "publish",
) -> dict[str, Any]:
    """Registers the pipeline's model of `root` and promotes it if nothing is in production.

    The metadata keeps the params, the benchmark metrics and the git revision.

    Returns:
        `{"version", "promoted", "path"}`.

    Raises:
        PruneOpsError: No pipeline output yet, or the params are invalid.
    """
    from pruneops.params import read_params

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
        registry.promote(version.version, reason + (" (forced)" if had_production else " (first model)"))
    return {"version": version.version, "promoted": promoted, "path": str(version.path)}
