"""Retraining-free structured pruning after Kwon et al. (2022), a fast post-training framework.

Two parts, each usable alone:

- `fisher_scores`: each head and each channel (an FFN neuron) gets a mask of ones where its
  output enters the next Linear; the diagonal of the empirical Fisher information of that mask,
  sum over samples of (dL/dm)^2, estimates the loss increase from removing it. Per-sample
  gradients come from giving every sample its own mask row.
- `reconstruct_linears_`: after removal, every Linear whose inputs were pruned is refit by ridge
  least squares so that, on calibration data, it reproduces the dense model's output of that
  layer from the pruned model's own inputs; layers are refit in forward order, so each one sees
  (and corrects) the error of those before it. Kwon et al. fit one scale per kept head/neuron;
  fitting the whole weight matrix is the same least-squares problem with more freedom, well
  determined with a few thousand tokens per kept input.

Where Kwon et al. search the mask globally under a FLOPs budget, PruneOps keeps its own plan (the
latency table's per-unit widths, measured in milliseconds); the Fisher scores decide which heads
and neurons fill those widths.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
import torch_pruning as tp
from torch import nn

from pruneops.inputs import run_model
from pruneops.pruning.heads import HeadSite


class _Stop(Exception):  # noqa: N818 - control flow, not an error: ends a forward pass early
    pass


def channel_consumers(pruner) -> dict[str, nn.Linear]:
    """Per channel unit of a `UnitPruner`, the Linear that takes its channels as inputs (if any).

    A unit without one (e.g. channels that feed a convolution) is left out: its channels keep
    the pruner's criterion.
    """
    found = {}
    for name, group in pruner._groups(pruner._graph()):
        size = len(group[0].idxs)
        for item in group[1:]:
            module = item.dep.target.module
            if (
                isinstance(module, nn.Linear)
                and item.dep.handler == tp.prune_linear_in_channels
                and module.in_features == size
            ):
                found[name] = module
                break
    return found


def _gate_hook(width: int, head_dim: int, store: list) -> Callable:
    """A pre-hook that multiplies a Linear's input by a per-sample gate of ones, kept in `store`."""

    def pre_hook(_: nn.Module, args: tuple) -> tuple:
        x = args[0]
        gate = torch.ones(x.shape[0], width, dtype=x.dtype, requires_grad=True)
        store.append(gate)
        shape = (x.shape[0],) + (1,) * (x.dim() - 2) + (width, 1)
        gated = x.reshape(*x.shape[:-1], width, head_dim) * gate.view(shape)
        return (gated.reshape(x.shape), *args[1:])

    return pre_hook


def fisher_scores(
    model: nn.Module,
    sites: dict[str, HeadSite],
    consumers: dict[str, nn.Linear],
    batches: Iterable[tuple[object, torch.Tensor]],
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """Diagonal empirical Fisher information of a mask on every head and consumed channel.

    Args:
        model: The model (left unchanged; its gradients are cleared).
        sites: Attention layers by name; a head's mask sits where its context enters `out`.
        consumers: Channel unit name -> the Linear that takes its channels (see `channel_consumers`).
        batches: (inputs, labels) pairs.

    Returns:
        (per site name, one score per head), (per channel unit, one score per channel); higher
        means removing it costs more.
    """
    points = {("head", n): (s.out, s.num_heads, s.head_dim) for n, s in sites.items()}
    points.update({("channel", n): (lin, lin.in_features, 1) for n, lin in consumers.items()})
    stores: dict[tuple[str, str], list] = {key: [] for key in points}
    totals = {key: torch.zeros(width) for key, (_, width, _) in points.items()}
    handles = [
        layer.register_forward_pre_hook(_gate_hook(width, head_dim, stores[key]))
        for key, (layer, width, head_dim) in points.items()
    ]
    was_training = model.training
    model.eval()
    try:
        for inputs, labels in batches:
            for store in stores.values():
                store.clear()
            # Summed, not averaged: each sample's gate gradient is then its own dL/dm.
            loss = F.cross_entropy(run_model(model, inputs), labels, reduction="sum")
            used = [key for key, store in stores.items() if store]
            grads = torch.autograd.grad(loss, [stores[key][0] for key in used], allow_unused=True)
            for key, g in zip(used, grads, strict=True):
                if g is not None:
                    totals[key] += g.detach().pow(2).sum(0)
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
        model.zero_grad(set_to_none=True)
    heads = {n: t for (kind, n), t in totals.items() if kind == "head"}
    channels = {n: t for (kind, n), t in totals.items() if kind == "channel"}
    return heads, channels


def pruned_linears(pruned: nn.Module, dense: nn.Module) -> list[str]:
    """Names of the Linears that lost inputs but kept their outputs, as `pruned` calls them."""
    dense_layers = dict(dense.named_modules())
    names = []
    for name, module in pruned.named_modules():
        ref = dense_layers.get(name)
        if (
            isinstance(module, nn.Linear)
            and isinstance(ref, nn.Linear)
            and module.in_features < ref.in_features
            and module.out_features == ref.out_features
        ):
            names.append(name)
    return names


def _call_order(model: nn.Module, names: list[str], inputs: object) -> list[str]:
    order: list[str] = []
    layers = dict(model.named_modules())
    handles = [layers[n].register_forward_hook(lambda *_, n=n: order.append(n)) for n in names]
    try:
        with torch.no_grad():
            run_model(model, inputs)
    finally:
        for h in handles:
            h.remove()
    return list(dict.fromkeys(order))


def _capture(model: nn.Module, layer: nn.Module, inputs: object, output: bool) -> torch.Tensor:
    """The layer's input (or output) on `inputs`; the forward pass stops there."""
    seen: list[torch.Tensor] = []

    def hook(_: nn.Module, args: tuple, out: torch.Tensor | None = None) -> None:
        seen.append(out if output else args[0])
        raise _Stop

    handle = layer.register_forward_hook(hook) if output else layer.register_forward_pre_hook(hook)
    try:
        with torch.no_grad():
            run_model(model, inputs)
    except _Stop:
        pass
    finally:
        handle.remove()
    return seen[0]


def _token_rows(t: torch.Tensor, inputs: object) -> torch.Tensor:
    """Rows of a (batch, [seq,] width) activation, without the padding positions of a text batch."""
    mask = inputs.get("attention_mask") if isinstance(inputs, dict) else None
    if mask is not None and t.dim() == 3 and t.shape[:2] == mask.shape:
        return t[mask.bool()]
    return t.reshape(-1, t.shape[-1])


@torch.no_grad()
def reconstruct_linears_(
    pruned: nn.Module, dense: nn.Module, batches: list[object], ridge: float = 1e-3
) -> dict[str, float]:
    """Refits each Linear that lost inputs to reproduce the dense model's output of that layer.

    Args:
        pruned: The pruned model, changed in place.
        dense: The model before pruning (same module names), unchanged.
        batches: Model inputs (calibration data).
        ridge: Tikhonov term, relative to the mean input energy (keeps rare inputs from blowing up).

    Returns:
        Per refit layer, its squared output error after the refit over the error before, on the
        first calibration batches (below 1: the refit helped).
    """
    names = pruned_linears(pruned, dense)
    if not names or not batches:
        return {}
    pruned_layers, dense_layers = dict(pruned.named_modules()), dict(dense.named_modules())
    was = pruned.training, dense.training
    pruned.eval()
    dense.eval()
    gains = {}
    for name in _call_order(pruned, names, batches[0]):
        layer, ref = pruned_layers[name], dense_layers[name]
        before = _output_error(pruned, dense, layer, ref, batches[:4])
        _refit_(layer, _normal_equations(pruned, dense, layer, ref, batches), ridge)
        gains[name] = _output_error(pruned, dense, layer, ref, batches[:4]) / max(before, 1e-30)
    pruned.train(was[0])
    dense.train(was[1])
    return gains


def _output_error(pruned: nn.Module, dense: nn.Module, layer: nn.Linear, ref: nn.Linear, batches) -> float:
    err = 0.0
    for inputs in batches:
        x = _token_rows(_capture(pruned, layer, inputs, output=False), inputs)
        y = _token_rows(_capture(dense, ref, inputs, output=True), inputs)
        err += (layer(x) - y).double().pow(2).sum().item()
    return err


def _normal_equations(pruned, dense, layer: nn.Linear, ref: nn.Linear, batches) -> tuple[torch.Tensor, torch.Tensor]:
    """X'X and X'Y over `batches`.

    X holds the layer's inputs in `pruned` (and a ones column for the bias), Y the dense layer's
    outputs; padding positions are left out.
    """
    width = layer.in_features + int(layer.bias is not None)
    gram = torch.zeros(width, width, dtype=torch.float64)
    cross = torch.zeros(width, layer.out_features, dtype=torch.float64)
    for inputs in batches:
        x = _token_rows(_capture(pruned, layer, inputs, output=False), inputs).double()
        y = _token_rows(_capture(dense, ref, inputs, output=True), inputs).double()
        if layer.bias is not None:
            x = torch.cat([x, torch.ones(len(x), 1, dtype=x.dtype)], dim=1)
        gram += x.T @ x
        cross += x.T @ y
    return gram, cross


def _refit_(layer: nn.Linear, equations: tuple[torch.Tensor, torch.Tensor], ridge: float) -> None:
    gram, cross = equations
    reg = ridge * gram.diagonal().mean().clamp_min(1e-12)
    solution = torch.linalg.solve(gram + reg * torch.eye(len(gram), dtype=gram.dtype), cross)
    layer.weight.copy_(solution[: layer.in_features].T.to(layer.weight.dtype))
    if layer.bias is not None:
        layer.bias.copy_(solution[-1].to(layer.bias.dtype))
