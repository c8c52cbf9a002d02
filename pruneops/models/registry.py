"""The model registry and `create_model` factory."""

from __future__ import annotations

import importlib
import inspect
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.core.inputs import example_input, run_model
from pruneops.core.plugins import Registry

MODELS: Registry = Registry("model")


@dataclass(frozen=True)
class ModelSpec:
    """Everything needed to rebuild an architecture (before any pruning).

    Args:
        name: A registered model name or `package.module:factory`.
        input_shape: Shape of one input sample, e.g. `[1, 8, 8]`.
        num_classes: Number of output logits.
        kwargs: Extra keyword arguments of the factory.
        classifier: Name of the output layer when finding it from the forward pass is not wanted.
        preprocess: `train.preprocess` (resize, channels, mean, std), run inside the model on the
            raw `input_shape` inputs; the factory is built for the preprocessed shape.
        inputs: Named inputs (`InputSpec.to_dict()`), e.g. a text model's ids and mask; None: one
            float input of `input_shape`.
    """

    name: str
    input_shape: list[int]
    num_classes: int
    kwargs: dict[str, Any] = field(default_factory=dict)
    classifier: str | None = None
    preprocess: dict[str, Any] | None = None
    inputs: list[dict[str, Any]] | None = None

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready form."""
        return asdict(self)


def resolve_factory(name: str):
    """The factory of a registered model name or of `package.module:factory`.

    Raises:
        ConfigError: Unknown name, or the import path does not import.
    """
    if ":" not in name:  # the built-in models register when `pruneops.models` is imported
        return MODELS.get(name)
    module_name, _, attr = name.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"train.model: cannot import factory {name!r} ({exc})") from None


def create_model(spec: ModelSpec) -> nn.Module:
    """Builds the architecture of `spec` with fresh weights.

    User factories (`package.module:factory`) are called as
    `factory(input_shape=..., num_classes=..., **kwargs)` (the shape after `preprocess`, which
    the model then runs first on raw inputs); `input_shape` only when the factory names it
    (torchvision's `mobilenet_v2(**kwargs)` hands every keyword to its class, which has no such
    argument).
    """
    from pruneops.core.inputs import InputSpec
    from pruneops.models.preprocess import attach_preprocess_, network_input_shape

    factory = resolve_factory(spec.name)
    network_shape = tuple(network_input_shape(spec.input_shape, spec.preprocess))
    shape = {"input_shape": network_shape} if _names_parameter(factory, "input_shape") else {}
    try:
        model = factory(**shape, num_classes=spec.num_classes, **spec.kwargs)
    except TypeError as exc:
        raise ConfigError(f"train.model_kwargs: not accepted by {spec.name!r} ({exc})") from None
    except (RuntimeError, ValueError, MemoryError) as exc:  # e.g. a size torch cannot allocate
        raise ConfigError(f"train.model: {spec.name!r} could not be built ({type(exc).__name__}: {exc})") from None
    if not isinstance(model, nn.Module):
        raise ConfigError(f"train.model: factory {spec.name!r} did not return a torch nn.Module")
    attach_preprocess_(model, spec.preprocess)
    # What `classifier_of` needs to find the output layer by running the model.
    model._pruneops_input_shape = tuple(spec.input_shape)
    model._pruneops_inputs = tuple(InputSpec.from_dict(i) for i in spec.inputs) if spec.inputs else None
    model._pruneops_classifier = spec.classifier
    if spec.classifier is not None and not isinstance(dict(model.named_modules()).get(spec.classifier), nn.Linear):
        raise ConfigError(f"train.classifier: {spec.classifier!r} is not a Linear layer of {spec.name!r}")
    return model


def _names_parameter(factory, name: str) -> bool:
    try:
        return name in inspect.signature(factory).parameters
    except (TypeError, ValueError):  # a builtin or C callable without a signature: pass everything
        return True


WEIGHTED = (nn.Linear, nn.Conv1d, nn.Conv2d)


@torch.no_grad()
def output_layer_name(model: nn.Module, input_shape: tuple[int, ...]) -> str | None:
    """The Linear/Conv that produces the model's output, found by running it once.

    The innermost weighted module whose output *is* the returned tensor; if a function comes
    after the last module (a mean, a reshape), the weighted module that finished last.
    """
    finished: list[tuple[str, nn.Module, object]] = []
    handles = [
        m.register_forward_hook(lambda mod, _, out, name=n: finished.append((name, mod, out)))
        for n, m in model.named_modules()
        if n
    ]
    was_training = model.training
    model.eval()
    try:
        output = run_model(model, example_input(model, input_shape))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    weighted = [(n, out) for n, m, out in finished if isinstance(m, WEIGHTED)]
    exact = [n for n, out in weighted if out is output]
    if exact:
        return exact[0]
    return weighted[-1][0] if weighted else None


def classifier_of(model: nn.Module) -> nn.Module:
    """The output layer, whose outputs are never pruned.

    `train.classifier` when given; else the layer that produces the output in a forward pass
    (not "the last registered Linear": a head registered before a squeeze-and-excitation Linear
    is still the head); models built outside `create_model` fall back to `model.classifier` or
    the last Linear.
    """
    modules = dict(model.named_modules())
    name = getattr(model, "_pruneops_classifier", None) or getattr(model, "_pruneops_output_layer", None)
    shape = getattr(model, "_pruneops_input_shape", None)
    if name is None and shape is not None:
        name = output_layer_name(model, shape)
        model._pruneops_output_layer = name  # the name survives pruning; the forward pass is run once
    if name is not None and name in modules:
        return modules[name]
    head = getattr(model, "classifier", None)
    if isinstance(head, nn.Module):
        return head
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    if not linears:
        raise ConfigError("model has no `classifier` attribute and no nn.Linear layer")
    return linears[-1]
