"""Pruning masks kept apart from the weights: save, load, re-apply, make permanent."""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from torch import nn

from pruneops.core.errors import CheckpointError


def save_masks(masks: dict[str, torch.Tensor], path: Path) -> None:
    """Writes masks (parameter name -> bool, True = kept) as uint8 safetensors."""
    save_file({k: v.to(torch.uint8).contiguous() for k, v in masks.items()}, str(path))


def load_masks(path: Path) -> dict[str, torch.Tensor]:
    """Reads masks written by `save_masks`; an absent file means no masks.

    Raises:
        CheckpointError: The file is damaged.
    """
    if not Path(path).exists():
        return {}
    try:
        return {k: v.bool() for k, v in load_file(str(path)).items()}
    except Exception as exc:  # safetensors raises several types for a damaged file
        raise CheckpointError(f"{path}: corrupt masks ({exc})") from None


@torch.no_grad()
def apply_masks_(model: nn.Module, masks: dict[str, torch.Tensor]) -> None:
    """Zeroes the masked-out entries of the named parameters (mask True = kept).

    Raises:
        CheckpointError: A mask names a parameter the model lacks or has another shape.
    """
    params = dict(model.named_parameters())
    for name, mask in masks.items():
        param = params.get(name)
        if param is None or param.shape != mask.shape:
            raise CheckpointError(f"mask {name!r} {list(mask.shape)} does not fit this architecture")
        param.mul_(mask)


def make_permanent_(model: nn.Module, masks: dict[str, torch.Tensor]) -> dict[str, float]:
    """Applies the masks for good (the weights hold the zeros); returns each layer's zero fraction.

    After this the model needs no masks: exporting it exports the zeros.
    """
    apply_masks_(model, masks)
    params = dict(model.named_parameters())
    return {name: float((params[name] == 0).float().mean()) for name in masks}
