"""Parameter and MAC counts, measured by running the model once with hooks."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from pruneops.core.inputs import example_input, run_model


def count_params(model: nn.Module) -> int:
    """Number of parameters (dense count: zeros included)."""
    return sum(p.numel() for p in model.parameters())


def count_nonzero_params(model: nn.Module) -> int:
    """Number of non-zero parameters."""
    return sum(int(torch.count_nonzero(p)) for p in model.parameters())


def _weight_count(w: torch.Tensor, nonzero: bool) -> int:
    return int(torch.count_nonzero(w)) if nonzero else w.numel()


@torch.no_grad()
def forward_with_hooks(
    model: nn.Module,
    input_shape: list[int] | tuple[int, ...],
    make_hook: Callable[[str], Callable],
    select: Callable[[nn.Module], bool] | None = None,
) -> None:
    """One eval-mode forward pass on a zero sample with `make_hook(name)` on each selected module.

    The hooks are removed and the model's train/eval mode restored afterwards, even on error.
    """
    handles = [m.register_forward_hook(make_hook(n)) for n, m in model.named_modules() if select is None or select(m)]
    was_training = model.training
    model.eval()
    try:
        run_model(model, example_input(model, input_shape))
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)


@torch.no_grad()
def layer_macs(model: nn.Module, input_shape: list[int] | tuple[int, ...], nonzero: bool = False) -> dict[str, int]:
    """Multiply-accumulates per module for one forward pass on a single sample.

    Counts Linear and Conv layers, plus any module's `extra_macs(inputs, output)` (attention
    matmuls), and the attention matmuls of every attention layer an adapter recognises (HF
    encoders, timm-style ViTs) at the example's sequence length (a text model: its `max_length`).
    With `nonzero`, weights that are exactly zero are not counted: the work a sparse
    kernel could skip, not what a dense kernel does.
    """
    macs: dict[str, int] = {}
    attention_out = _attention_outputs(model)

    def make_hook(name: str):
        def hook(module: nn.Module, inputs: tuple, output: torch.Tensor) -> None:
            n = 0
            if isinstance(module, nn.Linear):
                n = (output.numel() // output.shape[-1]) * _weight_count(module.weight, nonzero)
                if id(module) in attention_out and inputs[0].dim() == 3:
                    # Q @ K^T and softmax @ V: 2 * seq^2 * (heads * head_dim) per sample.
                    _, seq, width = inputs[0].shape
                    n += 2 * seq * seq * width * inputs[0].shape[0]
            elif isinstance(module, (nn.Conv1d, nn.Conv2d)):
                w = module.weight
                n = output.numel() // w.shape[0] * _weight_count(w, nonzero)
            if hasattr(module, "extra_macs"):
                n += int(module.extra_macs(inputs, output))
            if n:
                macs[name] = macs.get(name, 0) + n

        return hook

    forward_with_hooks(model, input_shape, make_hook)
    return macs


def _attention_outputs(model: nn.Module) -> set[int]:
    """Output projections of attention whose matmuls no module reports (`extra_macs`) itself."""
    from pruneops.core.errors import PruneOpsError
    from pruneops.pruning.heads import head_sites

    try:
        sites = head_sites(model)
    except PruneOpsError:  # attention nobody understands: its matmuls stay uncounted
        return set()
    return {id(s.out) for s in sites.values() if not hasattr(s.module, "extra_macs")}


def count_macs(model: nn.Module, input_shape: list[int] | tuple[int, ...], nonzero: bool = False) -> int:
    """Total MACs of one forward pass on a single sample (see `layer_macs`)."""
    return sum(layer_macs(model, input_shape, nonzero).values())
