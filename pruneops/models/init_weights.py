"""The user's own weights into a built architecture (`train.init_weights`).

A plain state dict, as people save them: safetensors, or a torch file read with
`weights_only=True` (no pickled code runs), optionally wrapped in `{"state_dict": ...}` or
`{"model": ...}` and prefixed `module.` by DataParallel. The classifier is re-initialised when
the file's has another class count (or always/never, as configured); every other mismatch is an
error that names the keys, unless `train.init_strict` is off (then a warning in the report).
"""

from __future__ import annotations

import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file
from torch import nn

from pruneops.core.errors import CheckpointError, ConfigError
from pruneops.models import classifier_of


@dataclass
class AdoptedWeights:
    """What loading the file did: the head reset or not, and keys that did not match."""

    path: str
    reset_classifier: bool
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)


def read_state_dict(path: Path) -> dict[str, torch.Tensor]:
    """The tensors of a weights file, by name.

    Raises:
        ConfigError: No such file.
        CheckpointError: Unreadable, pickled code, or not a mapping of names to tensors.
    """
    if not path.is_file():
        raise ConfigError(f"train.init_weights: {path} not found")
    try:
        if path.suffix == ".safetensors":
            state: object = load_file(str(path))
        else:
            state = torch.load(path, map_location="cpu", weights_only=True)
    except (SafetensorError, OSError, RuntimeError, EOFError, ValueError, zipfile.BadZipFile) as exc:
        raise CheckpointError(f"{path}: not a readable weights file ({type(exc).__name__}: {exc})") from None
    except Exception as exc:  # the unpickler refuses code with many exception types
        raise CheckpointError(f"{path}: refused ({type(exc).__name__}); only tensors are read (weights_only)") from None
    for wrapper in ("state_dict", "model"):
        if isinstance(state, Mapping) and isinstance(state.get(wrapper), Mapping):
            state = state[wrapper]
    if not isinstance(state, Mapping) or not state:
        raise CheckpointError(f"{path}: expected a state dict (names -> tensors), got {type(state).__name__}")
    bad = [k for k, v in state.items() if not isinstance(k, str) or not isinstance(v, torch.Tensor)]
    if bad:
        raise CheckpointError(f"{path}: entries that are not named tensors, e.g. {bad[:3]}")
    if all(k.startswith("module.") for k in state):
        state = {k.removeprefix("module."): v for k, v in state.items()}
    return dict(state)


def _head_keys(model: nn.Module) -> tuple[str, ...]:
    head = classifier_of(model)
    name = next(n for n, m in model.named_modules() if m is head)
    return tuple(f"{name}.{p}" for p, _ in head.named_parameters(recurse=False))


def load_init_weights_(model: nn.Module, path: Path, strict: bool, reset_classifier: bool | None) -> AdoptedWeights:
    """Loads the file into `model`, re-initialising its classifier as configured.

    Raises:
        CheckpointError: Shapes differ outside the classifier, or (strict) keys are missing or
            unexpected, or the classifier differs and `reset_classifier` is false.
    """
    state = read_state_dict(path)
    own = model.state_dict()
    head = _head_keys(model)
    head_differs = any(k in state and state[k].shape != own[k].shape for k in head)
    if head_differs and reset_classifier is False:
        shapes = {k: (list(state[k].shape), list(own[k].shape)) for k in head if k in state}
        raise CheckpointError(f"{path}: classifier shapes differ (file, model): {shapes}; set reset_classifier")
    reset = bool(reset_classifier) or head_differs
    if reset:
        state = {k: v for k, v in state.items() if k not in head}
    wrong = [
        f"{k} {list(v.shape)} vs {list(own[k].shape)}" for k, v in state.items() if k in own and v.shape != own[k].shape
    ]
    if wrong:
        raise CheckpointError(f"{path}: {len(wrong)} tensors do not fit the architecture, e.g. {wrong[:3]}")
    missing = sorted(k for k in own if k not in state and not (reset and k in head))
    unexpected = sorted(k for k in state if k not in own)
    if strict and (missing or unexpected):
        raise CheckpointError(
            f"{path}: does not match the architecture ({len(missing)} missing, e.g. {missing[:3]}; "
            f"{len(unexpected)} unexpected, e.g. {unexpected[:3]}); set train.init_strict: false to load the rest"
        )
    model.load_state_dict({k: v for k, v in state.items() if k in own}, strict=False)
    adopted = AdoptedWeights(str(path), reset, missing, unexpected)
    if missing or unexpected:
        adopted.warnings.append(
            f"init_weights: {len(missing)} tensors left as initialised ({missing[:3]}), "
            f"{len(unexpected)} in the file unused ({unexpected[:3]})"
        )
    return adopted
