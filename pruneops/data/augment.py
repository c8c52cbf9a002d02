"""Training augmentation of image batches: random crop with zero padding, horizontal flip."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pruneops.core.errors import ConfigError


def check_augmentable(section: str, augment, input_shape: list[int] | tuple[int, ...]) -> None:
    """Refuses `<section>.augment` on inputs that are not images (channels, height, width).

    Raises:
        ConfigError: The inputs are not 3-dimensional.
    """
    if augment is None or not (augment.crop_padding or augment.hflip):
        return
    if len(input_shape) != 3:
        raise ConfigError(
            f"{section}.augment: crops and flips need images (channels, height, width); this data's samples are "
            f"shaped {tuple(input_shape)}; set {section}.augment: null"
        )


def augment_images(x: torch.Tensor, crop_padding: int, hflip: bool, generator: torch.Generator) -> torch.Tensor:
    """A randomly cropped and/or flipped copy of a batch `x` (N, C, H, W); `x` is left as it is.

    Args:
        x: The batch.
        crop_padding: Zero pixels added on every side before cropping back to (H, W) at a random
            offset per image (0: no crop).
        hflip: Mirror each image left-right with probability 1/2.
        generator: The random source (one per training run: the same seed, the same draws).
    """
    n, c, h, w = x.shape
    if crop_padding:
        padded = F.pad(x, (crop_padding,) * 4)
        top = torch.randint(0, 2 * crop_padding + 1, (n,), generator=generator)
        left = torch.randint(0, 2 * crop_padding + 1, (n,), generator=generator)
        rows = (top[:, None] + torch.arange(h))[:, None, :, None]
        cols = (left[:, None] + torch.arange(w))[:, None, None, :]
        x = padded[torch.arange(n)[:, None, None, None], torch.arange(c)[None, :, None, None], rows, cols]
    if hflip:
        flip = torch.rand(n, generator=generator) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
    return x
