"""Retraining-free structured pruning after Kwon et al. (2022), a fast post-training framework.

Two parts, each usable alone:

- `fisher_scores`: each head and each channel (an FFN neuron) gets a mask of ones where its
  output enters the next Linear; the diagonal of the empirical Fisher information of that mask,
  sum over samples of (dL/dm)^2, estimates the loss increase from removing it. Per-sample
  gradients come from giving every sample its own mask row.
- `reconstruct_linears_`: after removal, each kept input of every Linear whose inputs were
  pruned gets a scale, fit by least squares so that, on calibration data, the layer reproduces
  the dense model's output of that layer from the pruned model's own inputs (Kwon et al.'s mask
  tuning, one scale per kept column rather than per head); layers are refit in forward order, so
  each one sees (and corrects) the error of those before it.

Where Kwon et al. search the mask globally under a FLOPs budget, PruneOps keeps its own plan (the
latency table's per-unit widths, measured in milliseconds); the Fisher scores decide which heads
and neurons fill those widths.

The refit lowers each layer's own output error but not the accuracy, so the `fisher` method does
not apply it (docs/explanation/structured-pruning.md#fisher-refit).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file
from torch import nn

from pruneops.core.inputs import run_model
from pruneops.pruning.heads import HeadSite

# Where the sensitivity stage's `fisher` estimator keeps the scores, keyed "head:<site>" and
# "channel:<unit>", so that the prune stage's `fisher` method need not compute them again.
FISHER_SCORES_FILE = "fisher_scores.safetensors"


def load_fisher_scores(
    path: Path, sites: dict[str, HeadSite], consumers: dict[str, nn.Linear]
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]] | None:
    """Saved `fisher_scores` of this model, or None when absent or not matching its heads and channels."""
    if not path.exists():
        return None
    saved = load_file(str(path))
    heads = {n: saved.get(f"head:{n}") for n, s in sites.items()}
    channels = {n: saved.get(f"channel:{n}") for n in consumers}
    fits = all(t is not None and t.numel() == sites[n].num_heads for n, t in heads.items()) and all(
        t is not None and t.numel() == consumers[n].in_features for n, t in channels.items()
    )
    return (heads, channels) if fits else None


class _Stop(Exception):  # noqa: N818 - control flow, not an error: ends a forward pass early
    pass


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
        consumers: Channel unit name -> the Linear that takes its channels (`UnitPruner.linear_consumers`).
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


def _layer_input(model: nn.Module, layer: nn.Module, inputs: object) -> torch.Tensor:
    """The layer's input on `inputs`; the forward pass stops there."""
    seen: list[torch.Tensor] = []

    def pre_hook(_: nn.Module, args: tuple) -> None:
        seen.append(args[0])
        raise _Stop

    handle = layer.register_forward_pre_hook(pre_hook)
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
    """Rescales each kept input of every Linear that lost inputs, to reproduce the dense layer's output.

    Kwon et al.'s mask tuning: with the weights W and bias fixed, the output is W diag(m) x + b,
    linear in the per-input scales m (one per kept column: per head dimension, per neuron).
    Least squares over the calibration tokens gives m; the ridge pulls m towards 1 (the weights
    as they are), so inputs the data barely excite stay unchanged. Refitting the whole matrix
    instead fits the calibration tokens better and measured worse on held-out reviews (MiniLM,
    40% removed: 80.9% against 81.6% without any refit), hence scales.

    Args:
        pruned: The pruned model, changed in place.
        dense: The model before pruning (same module names), unchanged.
        batches: Model inputs (calibration data).
        ridge: Pull towards unchanged scales, relative to the mean diagonal of the problem.

    Returns:
        Per refit layer, its squared output error on the calibration data after the refit over
        the error before (below 1: the refit helped).
    """
    names = pruned_linears(pruned, dense)
    if not names or not batches:
        return {}
    pruned_layers = dict(pruned.named_modules())
    was = pruned.training, dense.training
    pruned.eval()
    dense.eval()
    order = _call_order(pruned, names, batches[0])
    targets = _dense_outputs(dense, order, batches)  # one pass: the dense model does not change
    gains = {}
    for name in order:
        layer = pruned_layers[name]
        inputs = [_token_rows(_layer_input(pruned, layer, b), b).double() for b in batches]
        gains[name] = _rescale_inputs_(layer, inputs, targets[name], ridge)
    pruned.train(was[0])
    dense.train(was[1])
    return gains


def _dense_outputs(dense: nn.Module, names: list[str], batches: list[object]) -> dict[str, list[torch.Tensor]]:
    """Each named Linear's output rows (padding left out) on every batch, from one forward pass each."""
    layers = dict(dense.named_modules())
    outputs: dict[str, list[torch.Tensor]] = {n: [] for n in names}
    current: list[object] = []

    def keep(name: str):
        return lambda _m, _a, out: outputs[name].append(_token_rows(out, current[0]))

    handles = [layers[n].register_forward_hook(keep(n)) for n in names]
    try:
        for inputs in batches:
            current[:] = [inputs]
            run_model(dense, inputs)
    finally:
        for h in handles:
            h.remove()
    return outputs


def _rescale_inputs_(layer: nn.Linear, xs: list[torch.Tensor], ys: list[torch.Tensor], ridge: float) -> float:
    """Least-squares per-input scales m of `layer` (output W diag(m) x + b) towards targets `ys`.

    With A = X'X and C = X'(Y - b), the normal equations are (A * W'W) m = diag(C W), `*` the
    elementwise product; the ridge adds lambda (m - 1). Returns the error ratio after/before.
    """
    weight = layer.weight.double()
    bias = layer.bias.double() if layer.bias is not None else torch.zeros(layer.out_features, dtype=torch.float64)
    gram = torch.zeros(layer.in_features, layer.in_features, dtype=torch.float64)
    cross = torch.zeros(layer.in_features, layer.out_features, dtype=torch.float64)
    energy = 0.0
    for x, y in zip(xs, ys, strict=True):
        residual = y.double() - bias
        gram += x.T @ x
        cross += x.T @ residual
        energy += residual.pow(2).sum().item()
    system = gram * (weight.T @ weight)
    rhs = (cross * weight.T).sum(1)
    reg = ridge * system.diagonal().mean().clamp_min(1e-12)
    scales = torch.linalg.solve(system + reg * torch.eye(len(system), dtype=system.dtype), rhs + reg)

    def error(m: torch.Tensor) -> float:  # ||Y - b||^2 - 2 m'rhs + m'(system)m, from the sums
        return energy - 2 * float(m @ rhs) + float(m @ system @ m)

    before = error(torch.ones_like(scales))
    layer.weight.copy_((weight * scales).to(layer.weight.dtype))
    return error(scales) / max(before, 1e-30)
