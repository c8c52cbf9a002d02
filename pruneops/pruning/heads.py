"""Attention heads as prunable units, for our own attention and HuggingFace BERT-family models.

An adapter turns an attention module into a `HeadSite`: its Q/K/V projections (a head is a block
of `head_dim` output rows), its output projection (a block of input columns) and a setter for
the module's head count. Removing heads slices those rows/columns; the gate importance of Michel
et al. (2019) multiplies each head's context by a gate and reads |dL/dgate| over data.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pruneops.registry import Registry


@dataclass
class HeadSite:
    """One attention layer as head removal sees it.

    `projections` are the layers whose output rows hold the heads: Q, K and V as three Linears
    (`parts` 1), or one fused `qkv` Linear whose rows stack Q, K and V (`parts` 3); `out` takes the
    heads' context as input columns.
    """

    module: nn.Module
    projections: tuple[nn.Linear, ...]
    out: nn.Linear
    head_dim: int
    set_num_heads: Callable[[int], None]
    parts: int = 1

    @property
    def num_heads(self) -> int:
        """Current number of heads."""
        return self.projections[0].out_features // (self.head_dim * self.parts)

    def head_matrix(self, grad: bool = False) -> torch.Tensor | None:
        """Per head, its projection rows and output columns flattened: shape (num_heads, -1).

        Args:
            grad: The same arrangement of the gradients (None when there are none).
        """
        h, d = self.num_heads, self.head_dim
        mats = [p.weight.grad if grad else p.weight for p in (*self.projections, self.out)]
        if any(m is None for m in mats):
            return None
        parts = [m.reshape(self.parts, h, d, -1).transpose(0, 1).reshape(h, -1) for m in mats[:-1]]
        parts.append(mats[-1].reshape(-1, h, d).transpose(0, 1).reshape(h, -1))
        return torch.cat(parts, dim=1).detach()


HEAD_ADAPTERS: Registry[Callable[[nn.Module], HeadSite | None]] = Registry("attention adapter")


def _linears(module: nn.Module, names: tuple[str, ...]) -> tuple[nn.Linear, ...] | None:
    found = tuple(getattr(module, n, None) for n in names)
    return found if all(isinstance(m, nn.Linear) for m in found) else None


@HEAD_ADAPTERS.register("pruneops", "the token transformer's MultiHeadSelfAttention (q, k, v, out)")
def own_attention(module: nn.Module) -> HeadSite | None:
    """Our attention: `q`, `k`, `v`, `out` and `num_heads`/`head_dim` attributes."""
    layers = _linears(module, ("q", "k", "v", "out"))
    if layers is None or not hasattr(module, "num_heads") or not hasattr(module, "head_dim"):
        return None
    return HeadSite(module, layers[:3], layers[3], module.head_dim, lambda n: setattr(module, "num_heads", n))


@HEAD_ADAPTERS.register("fused_qkv", "one fused qkv Linear and an output proj, with num_heads (timm's ViT layout)")
def fused_qkv_attention(module: nn.Module) -> HeadSite | None:
    """timm-style attention: `qkv` (3 x heads x head_dim rows), `proj`, and a `num_heads` attribute."""
    layers = _linears(module, ("qkv", "proj"))
    heads = getattr(module, "num_heads", None)
    if layers is None or not isinstance(heads, int) or heads < 1 or layers[0].out_features % (3 * heads):
        return None
    head_dim = layers[0].out_features // (3 * heads)
    if layers[1].in_features != heads * head_dim:
        return None

    def set_heads(n: int) -> None:
        module.num_heads = n

    return HeadSite(module, (layers[0],), layers[1], head_dim, set_heads, parts=3)


@HEAD_ADAPTERS.register("bert", "HuggingFace BERT-family attention (self.query/key/value, output.dense)")
def bert_attention(module: nn.Module) -> HeadSite | None:
    """BertAttention-style modules (BERT, RoBERTa, ...): `self` and `output` children."""
    core, output = getattr(module, "self", None), getattr(module, "output", None)
    if core is None or output is None or not hasattr(core, "attention_head_size"):
        return None
    layers = _linears(core, ("query", "key", "value"))
    if layers is None or not isinstance(getattr(output, "dense", None), nn.Linear):
        return None

    def set_heads(n: int) -> None:
        core.num_attention_heads = n
        core.all_head_size = n * core.attention_head_size

    return HeadSite(module, layers, output.dense, core.attention_head_size, set_heads)


def head_sites(model: nn.Module) -> dict[str, HeadSite]:
    """Every attention layer of `model` that an adapter recognises, by module name."""
    sites: dict[str, HeadSite] = {}
    for name, module in model.named_modules():
        for entry in HEAD_ADAPTERS:
            site = entry.obj(module)
            if site is not None:
                sites[name] = site
                break
    return sites


@torch.no_grad()
def remove_heads_(site: HeadSite, heads: Iterable[int]) -> None:
    """Physically removes `heads`: slices Q/K/V rows and output columns, updates the count."""
    drop = set(heads)
    keep = [h for h in range(site.num_heads) if h not in drop]
    if not keep:
        raise ValueError("cannot remove every head of an attention layer")
    d, h = site.head_dim, site.num_heads
    cols = torch.tensor([k * d + i for k in keep for i in range(d)], dtype=torch.long)
    # In a fused projection each part (Q, K, V) holds every head: keep the same heads in each.
    rows = torch.tensor([p * h * d + c for p in range(site.parts) for c in cols.tolist()], dtype=torch.long)
    for proj in site.projections:
        proj.weight = nn.Parameter(proj.weight[rows].clone())
        if proj.bias is not None:
            proj.bias = nn.Parameter(proj.bias[rows].clone())
        proj.out_features = len(rows)
    site.out.weight = nn.Parameter(site.out.weight[:, cols].clone())
    site.out.in_features = len(cols)
    site.set_num_heads(len(keep))


def gate_importance(
    model: nn.Module,
    sites: dict[str, HeadSite],
    batches: Iterable[tuple[object, torch.Tensor]],
    forward: Callable[[nn.Module, object], torch.Tensor] | None = None,
) -> dict[str, torch.Tensor]:
    """Head importance of Michel et al. (2019): E|dL/d gate_h|, normalised per layer (L2).

    A gate of ones multiplies each head's context vector where it enters the output projection;
    the loss gradient with respect to the gate, accumulated in absolute value over `batches`,
    is the expected loss change from masking the head.

    Args:
        model: The model (left unchanged; its gradients are cleared).
        sites: The attention layers to score.
        batches: (inputs, labels) pairs.
        forward: Maps (model, inputs) to logits; default `model(inputs)`.
    """
    forward = forward or (lambda m, x: m(x))
    gates = {name: torch.ones(site.num_heads, requires_grad=True) for name, site in sites.items()}
    totals = {name: torch.zeros(site.num_heads) for name, site in sites.items()}

    def make_hook(name: str, site: HeadSite):
        def pre_hook(_: nn.Module, args: tuple) -> tuple:
            x = args[0]
            gated = x.reshape(*x.shape[:-1], site.num_heads, site.head_dim) * gates[name].view(-1, 1)
            return (gated.reshape(x.shape), *args[1:])

        return pre_hook

    handles = [s.out.register_forward_pre_hook(make_hook(n, s)) for n, s in sites.items()]
    was_training = model.training
    model.eval()
    try:
        for inputs, labels in batches:
            loss = nn.functional.cross_entropy(forward(model, inputs), labels)
            grads = torch.autograd.grad(loss, list(gates.values()))
            for name, g in zip(gates, grads, strict=True):
                totals[name] += g.abs()
    finally:
        for h in handles:
            h.remove()
        model.train(was_training)
    return {name: t / t.norm().clamp_min(1e-12) for name, t in totals.items()}
