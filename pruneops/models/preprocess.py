"""Input preprocessing declared in params and saved with the model (it runs inside the model).

`train.preprocess` (resize, grayscale -> N channels, mean/std) becomes part of the model: a
`InputPreprocess` module attached as `model.input_preprocess` and run by a forward pre-hook, so
the model's own module names stay as its author (and a pretrained state dict) named them. Its
buffers are not persistent: the checkpoint's spec rebuilds them. Every export of the model, the
deployed ONNX file included, starts with these operations, so serving feeds raw inputs (scaled to
[0, 1] as `validate` scales them) and the latency measured is what serving pays.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from pruneops.core.errors import ConfigError

ATTRIBUTE = "input_preprocess"


class InputPreprocess(nn.Module):
    """Resize (bilinear), repeat a single channel, then `(x - mean) / std` per channel."""

    def __init__(
        self,
        resize: list[int] | None = None,
        channels: int | None = None,
        mean: list[float] | None = None,
        std: list[float] | None = None,
    ):
        super().__init__()
        self.resize = tuple(resize) if resize else None
        self.channels = channels
        n = len(mean or std or [0.0])
        self.register_buffer("mean", torch.tensor(mean or [0.0] * n).view(1, -1, 1, 1), persistent=False)
        self.register_buffer("std", torch.tensor(std or [1.0] * n).view(1, -1, 1, 1), persistent=False)
        self.normalize = mean is not None or std is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """Raw (N, C, H, W) inputs to what the network was built for."""
        if self.resize is not None and tuple(x.shape[-2:]) != self.resize:
            x = F.interpolate(x, size=self.resize, mode="bilinear", align_corners=False)
        if self.channels is not None and x.shape[1] != self.channels:
            x = x.expand(-1, self.channels, -1, -1)
        if self.normalize:
            x = (x - self.mean) / self.std
        return x


def _run_preprocess(module: nn.Module, args: tuple) -> tuple:
    # A module-level function (not a closure) so that deep copies and pickles of the model keep it.
    return (getattr(module, ATTRIBUTE)(args[0]), *args[1:])


def network_input_shape(input_shape: list[int], preprocess: dict[str, Any] | None) -> list[int]:
    """The shape the network itself sees: the data's shape after resize and channel repeat.

    Raises:
        ConfigError: Preprocessing that does not fit the data (channels, image rank, mean/std length).
    """
    if not preprocess:
        return list(input_shape)
    if len(input_shape) != 3:
        raise ConfigError(f"train.preprocess: needs images (C, H, W); the data's inputs are {list(input_shape)}")
    c, h, w = input_shape
    channels = preprocess.get("channels") or c
    if channels != c and c != 1:
        raise ConfigError(f"train.preprocess.channels: {channels} from {c}-channel images (only 1 -> N repeats)")
    for key in ("mean", "std"):
        values = preprocess.get(key)
        if values is not None and len(values) not in (1, channels):
            raise ConfigError(
                f"train.preprocess.{key}: {len(values)} values for {channels} channels "
                f"(give {'1' if channels == 1 else f'1 or {channels}'})"
            )
    h, w = preprocess.get("resize") or (h, w)
    return [channels, h, w]


def attach_preprocess_(model: nn.Module, preprocess: dict[str, Any] | None) -> nn.Module:
    """Adds the preprocessing to `model` (in place) as a submodule run before its forward."""
    if not preprocess:
        return model
    model.add_module(ATTRIBUTE, InputPreprocess(**preprocess))
    model.register_forward_pre_hook(_run_preprocess)
    return model
