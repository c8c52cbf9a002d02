"""Running a model over arrays: batched logits, and the channels-last layout where it is safe."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import torch
from torch import nn

from pruneops.core.inputs import as_tensors, count_rows, length_order, rows, run_model, trim_padding


@contextmanager
def channels_last_(*models: nn.Module | None) -> Iterator[bool]:
    """Stores the 4-D weights of convolutional `models` channels-last inside the block.

    PyTorch's CPU kernels train depthwise and pointwise convolutions 1.2-3x faster on
    channels-last tensors (MobileNetV2 at 64x64: 157 -> 481 images/s on 2 cores), and a conv
    with a channels-last weight makes its output channels-last, so the inputs need no change.
    The weights are stored contiguously again on exit, as checkpoints, pruning and export expect.
    Yields whether any model was converted: models without a Conv2d are left alone, and so are
    models already converted by an enclosing block (which restores them), and models with a
    convolution that PyTorch's channels-last kernels get wrong (`_channels_last_unsafe`).
    """
    convolutional = [m for m in models if m is not None and _stored_contiguously(m) and not _channels_last_unsafe(m)]
    for m in convolutional:
        m.to(memory_format=torch.channels_last)
    try:
        yield bool(convolutional)
    finally:
        for m in convolutional:
            m.to(memory_format=torch.contiguous_format)


def _channels_last_unsafe(model: nn.Module) -> bool:
    """Whether `model` has a strided 1x1 Conv2d over fewer than 8 input channels.

    Its channels-last backward pass in torch 2.13's CPU build corrupts the heap on AVX2 CPUs
    (docs/explanation/training.md#channels-last). Pruning makes such widths, so those models
    train in NCHW.
    """
    return any(
        isinstance(m, nn.Conv2d) and m.kernel_size == (1, 1) and max(m.stride) > 1 and m.in_channels < 8
        for m in model.modules()
    )


def _stored_contiguously(model: nn.Module) -> bool:
    """Whether `model` has a Conv2d whose weight is stored in the standard (NCHW) layout."""
    weights = [m.weight for m in model.modules() if isinstance(m, nn.Conv2d)]
    return any(w.is_contiguous() and not w.is_contiguous(memory_format=torch.channels_last) for w in weights)


@torch.no_grad()
def predict_logits(model: nn.Module, x: np.ndarray, batch_size: int = 512) -> torch.Tensor:
    """Logits of `model` (eval mode) over `x`, in the order of `x`.

    Texts are run shortest first, so that each batch is cut to its own longest text rather than
    to the data's padded length (about 0.6 of the work on review snippets).
    """
    model.eval()
    xs = as_tensors(x)
    order = length_order(xs)
    if order is not None:
        xs = rows(xs, order)
    chunks = (trim_padding(rows(xs, slice(i, i + batch_size))) for i in range(0, count_rows(xs), batch_size))
    with channels_last_(model):
        logits = torch.cat([run_model(model, xb) for xb in chunks])
    if order is None:
        return logits
    restored = torch.empty_like(logits)
    restored[order] = logits
    return restored
