"""A pruned model's structure: the shape attributes of every resized module, saved beside its weights."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# Attributes that describe a module's shape; pruning edits them along with the weights.
SHAPE_ATTRS = (
    "in_features",
    "out_features",
    "in_channels",
    "out_channels",
    "groups",
    "num_features",
    "normalized_shape",
    "num_heads",
    "head_dim",
    "num_attention_heads",
    "n_heads",
    "all_head_size",
    "num_embeddings",
    "embedding_dim",
)


def module_structure(model: nn.Module) -> dict[str, dict[str, Any]]:
    """The shape attributes (`SHAPE_ATTRS`) of every module that has any, by module name."""
    out: dict[str, dict[str, Any]] = {}
    for name, module in model.named_modules():
        attrs = {a: getattr(module, a) for a in SHAPE_ATTRS if isinstance(getattr(module, a, None), (int, tuple))}
        if attrs:
            out[name] = {k: list(v) if isinstance(v, tuple) else v for k, v in attrs.items()}
    return out


def resize_to_structure_(
    model: nn.Module, structure: dict[str, dict[str, Any]], state: dict[str, torch.Tensor]
) -> None:
    """Gives every module the shape attributes of `structure` and parameters shaped like `state`.

    Raises:
        ValueError: `structure` names a module the model does not have.
    """
    modules = dict(model.named_modules())
    for name, attrs in structure.items():
        module = modules.get(name)
        if module is None:
            raise ValueError(f"module {name!r} of the checkpoint is not in the architecture")
        for attr, value in attrs.items():
            if hasattr(module, attr):
                setattr(module, attr, tuple(value) if isinstance(value, list) else value)
    for key, tensor in state.items():
        mod_name, _, leaf = key.rpartition(".")
        module = modules.get(mod_name)
        if module is not None:
            _shape_like_(module, leaf, tensor)


def _shape_like_(module: nn.Module, leaf: str, tensor: torch.Tensor) -> None:
    """Replaces `module.<leaf>` by an empty tensor shaped like `tensor` where its shape differs."""
    current = getattr(module, leaf, None)
    if leaf in module._buffers and current is None:
        # An optional buffer (registered as None) that this checkpoint holds, e.g. a token map.
        module._buffers[leaf] = torch.empty_like(tensor)
    elif isinstance(current, torch.Tensor) and current.shape != tensor.shape:
        if leaf in module._parameters:
            module._parameters[leaf] = nn.Parameter(torch.empty_like(tensor))
        elif leaf in module._buffers:
            module._buffers[leaf] = torch.empty_like(tensor)
