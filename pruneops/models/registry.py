"""The model registry and `create_model` factory."""

from __future__ import annotations

import importlib
from dataclasses import asdict, dataclass, field
from typing import Any

from torch import nn

from pruneops.errors import ConfigError
from pruneops.registry import Registry

MODELS: Registry = Registry("model")


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild an architecture (before any pruning).

    Args:
        name: A registered model name or `package.module:factory`.
        input_shape: Shape of one input sample, e.g. `[1, 8, 8]`.
        num_classes: Number of output logits.
        kwargs: Extra keyword arguments of the factory.
    """

    name: str
    input_shape: list[int]
    num_classes: int
    kwargs: dict[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def resolve_factory(name: str):
    """The factory of a registered model name or of `package.module:factory`.

    Raises:
        ConfigError: Unknown name, or the import path does not import.
    """
    if ":" not in name:
        import pruneops.models.architectures  # noqa: F401 - registers the built-in models

        return MODELS.get(name)
    module_name, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"train.model: cannot import factory {name!r} ({exc})") from None


def create_model(spec: ModelSpec) -> nn.Module:
    """Builds the architecture of `spec` with fresh weights.

    User factories (`package.module:factory`) are called as
    `factory(input_shape=..., num_classes=..., **kwargs)`.
    """
    factory = resolve_factory(spec.name)
    try:
        model = factory(input_shape=tuple(spec.input_shape), num_classes=spec.num_classes, **spec.kwargs)
    except TypeError as exc:
        raise ConfigError(f"train.model_kwargs: not accepted by {spec.name!r} ({exc})") from None
    except (RuntimeError, ValueError, MemoryError) as exc:  # e.g. a size torch cannot allocate
        raise ConfigError(f"train.model: {spec.name!r} could not be built ({type(exc).__name__}: {exc})") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"train.model: factory {spec.name!r} did not return a torch nn.Module")
    return model


def classifier_of(model: nn.Module) -> nn.Module:
    """The output layer, whose outputs are never pruned: `model.classifier` or the last Linear."""
    head = getattr(model, "classifier", None)
    if isinstance(head, nn.Module):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("model has no `classifier` attribute and no nn.Linear layer")
    return linears[-1]
