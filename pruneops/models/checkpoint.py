"""Safetensors checkpoints that reload pruned (reshaped) models without pickles.

The file holds the state dict plus JSON metadata: the `ModelSpec` that builds the original
architecture and, per module, the shape attributes that pruning changed (`out_features`,
`num_heads`...). Loading builds the architecture, resizes every module to the saved shapes and
loads the weights strictly.

Integrity: `save_checkpoint` writes the file's SHA-256 beside it (`<file>.sha256`) and
`load_checkpoint` refuses a file whose bytes no longer match (flipped bytes in the tensor data
would otherwise load and run). `check_recorded_accuracy` refuses a baseline whose validation
accuracy is far below the one recorded when it was trained.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn

from pruneops.core.errors import CheckpointError, ConfigError
from pruneops.core.integrity import verify_file, write_checksum
from pruneops.models import ModelSpec, create_model
from pruneops.models.structure import module_structure, resize_to_structure_


@dataclass
class Checkpoint:
    """A loaded checkpoint: the model (eval mode) and its metadata."""

    model: nn.Module
    spec: ModelSpec
    extra: dict[str, Any] = field(default_factory=dict)


def save_checkpoint(path: Path, model: nn.Module, spec: ModelSpec, extra: dict[str, Any] | None = None) -> str:
    """Writes `model` as safetensors with the metadata needed to rebuild its pruned shape.

    Returns:
        The file's SHA-256, also written beside it.
    """
    state = {k: v.detach().contiguous().clone() for k, v in model.state_dict().items()}
    meta = {"spec": spec.to_dict(), "structure": module_structure(model), "extra": extra or {}}
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path), metadata={"pruneops": json.dumps(meta)})
    return write_checksum(path)


def verify_checksum(path: Path) -> None:
    """Refuses a checkpoint whose bytes differ from the SHA-256 recorded when it was written.

    Raises:
        CheckpointError: No recorded checksum, or a mismatch.
    """
    verify_file(path, error=CheckpointError)


def check_recorded_accuracy(checkpoint: Checkpoint, measured: float, samples: int, path: Path) -> None:
    """Refuses a model whose validation accuracy is far below what was recorded when it was trained.

    Evaluating the same weights on the same split gives the same accuracy; the margin (4 standard
    errors, at least 2 points) only allows for a different split of the same data.

    Raises:
        CheckpointError: The measured accuracy is below the recorded one by more than the margin.
    """
    recorded = checkpoint.extra.get("val_accuracy")
    if recorded is None or samples < 1:
        return
    margin = max(0.02, 4 * math.sqrt(max(recorded * (1 - recorded), 1e-4) / samples))
    if measured < recorded - margin:
        raise CheckpointError(
            f"{path}: validation accuracy {100 * measured:.2f}% is far below the {100 * recorded:.2f}% recorded "
            "when it was trained: the weights or the data changed; rerun `pruneops train`"
        )


def read_metadata(path: Path) -> dict[str, Any]:
    """The PruneOps metadata of a checkpoint, without loading its weights."""
    from safetensors import safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            raw = (f.metadata() or {}).get("pruneops")
    except FileNotFoundError:
        raise CheckpointError(f"{path}: checkpoint not found") from None
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint ({exc})") from None
    if raw is None:
        raise CheckpointError(f"{path}: not a PruneOps checkpoint (no metadata)")
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint metadata ({exc})") from None


def load_checkpoint(path: Path, fits: object | None = None) -> Checkpoint:
    """Rebuilds the model saved at `path` (pruned shapes included) in eval mode.

    Args:
        path: The checkpoint.
        fits: The prepared data's metadata (`DataMeta`): the checkpoint must be built for its
            input shape and class count (a checkpoint of another project, copied in with its
            checksum, is refused here rather than failing inside a forward pass).

    Raises:
        CheckpointError: Missing, corrupt (checksum), not matching its architecture, or built for
            other data than `fits`.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"{path}: checkpoint not found")
    verify_checksum(path)
    meta = read_metadata(path)
    try:
        state = load_file(str(path))
    except (SafetensorError, OSError, ValueError) as exc:
        raise CheckpointError(f"{path}: corrupt checkpoint ({exc})") from None
    try:
        spec = ModelSpec(**meta["spec"])
        model = create_model(spec)
        resize_to_structure_(model, meta.get("structure", {}), state)
        model.load_state_dict(state, strict=True)
    except (KeyError, TypeError, ValueError, RuntimeError, ConfigError) as exc:
        raise CheckpointError(f"{path}: checkpoint does not fit its architecture ({exc})") from None
    if fits is not None:
        _check_fits(path, spec, fits)
    model.eval()
    return Checkpoint(model, spec, meta.get("extra", {}))


def _check_fits(path: Path, spec: ModelSpec, data: object) -> None:
    shape, classes = list(getattr(data, "input_shape", spec.input_shape)), getattr(data, "num_classes", None)
    if list(spec.input_shape) != shape or (classes is not None and spec.num_classes != classes):
        raise CheckpointError(
            f"{path}: built for inputs {list(spec.input_shape)} and {spec.num_classes} classes; the prepared data "
            f"has inputs {shape} and {classes} classes (a checkpoint of another project?); rerun `pruneops train`"
        )
