"""Attention heads as prunable units, for our own attention, timm-style ViTs and HuggingFace encoders.

An adapter turns an attention module into a `HeadSite`: its Q/K/V projections (a head is a block
of `head_dim` output rows), its output projection (a block of input columns) and a setter for
the module's head count. Removing heads slices those rows/columns; the gate importance of Michel
et al. (2019) multiplies each head's context by a gate and reads |dL/dgate| over data.

Adapters recognise attention by structure (Q/K/V Linears, a head count attribute, the Linear
that takes their width), so HuggingFace encoders other than BERT are found without their
attribute names. A `HeadTie` groups layers that must lose the same heads (MPNet's shared
relative-position bias). Attention no adapter understands, or shared by several layers, is
refused rather than pruned channel by channel.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

import torch
from torch import nn

from pruneops.core.errors import PruneOpsError
from pruneops.core.inputs import run_model
from pruneops.core.plugins import Registry


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


# An adapter sees one module and its parent (the output projection of a HuggingFace layout sits
# in a sibling, e.g. BERT's `attention.output.dense`) and returns a site, or None if it does not
# recognise the module.
HeadAdapter = Callable[[nn.Module, "nn.Module | None"], "HeadSite | None"]
HEAD_ADAPTERS: Registry[HeadAdapter] = Registry("attention adapter")

# How attention modules name their head count and head width across HuggingFace families
# (BERT/RoBERTa/ELECTRA/MPNet/ALBERT: num_attention_heads, attention_head_size; DistilBERT:
# n_heads; ViT-style code: num_heads, head_dim).
HEAD_COUNT_ATTRS = ("num_attention_heads", "n_heads", "num_heads")
HEAD_SIZE_ATTRS = ("attention_head_size", "head_dim", "head_size")


def _linears(module: nn.Module, names: tuple[str, ...]) -> tuple[nn.Linear, ...] | None:
    found = tuple(getattr(module, n, None) for n in names)
    return found if all(isinstance(m, nn.Linear) for m in found) else None


def _int_attr(module: nn.Module, names: tuple[str, ...]) -> int | None:
    for name in names:
        value = getattr(module, name, None)
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    return None


def looks_like_attention(module: nn.Module) -> bool:
    """A head count attribute and at least three Linear children: what an attention block has."""
    linears = sum(isinstance(m, nn.Linear) for m in module.children())
    return _int_attr(module, HEAD_COUNT_ATTRS) is not None and linears >= 3


@HEAD_ADAPTERS.register("pruneops", "the token transformer's MultiHeadSelfAttention (q, k, v, out)")
def own_attention(module: nn.Module, parent: nn.Module | None = None) -> HeadSite | None:
    """Our attention: `q`, `k`, `v`, `out` and `num_heads`/`head_dim` attributes."""
    layers = _linears(module, ("q", "k", "v", "out"))
    if layers is None or not hasattr(module, "num_heads") or not hasattr(module, "head_dim"):
        return None
    return HeadSite(module, layers[:3], layers[3], module.head_dim, lambda n: setattr(module, "num_heads", n))


@HEAD_ADAPTERS.register("fused_qkv", "one fused qkv Linear and an output proj, with num_heads (timm's ViT layout)")
def fused_qkv_attention(module: nn.Module, parent: nn.Module | None = None) -> HeadSite | None:
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


def _qkv_and_rest(module: nn.Module) -> tuple[list[nn.Linear], list[nn.Linear]] | None:
    """The first three consecutive Linear children of one shape (Q, K, V) and the Linears after them."""
    linears = [m for m in module.children() if isinstance(m, nn.Linear)]
    for i in range(len(linears) - 2):
        trio = linears[i : i + 3]
        if len({(m.in_features, m.out_features) for m in trio}) == 1:
            return trio, linears[i + 3 :]
    return None


def _output_projection(
    module: nn.Module, parent: nn.Module | None, rest: list[nn.Linear], width: int
) -> nn.Linear | None:
    """The Linear that takes the heads' context.

    A later child (DistilBERT's `out_lin`, MPNet's `o`), else the first Linear in a sibling
    registered after the module (BERT's `output.dense`).
    """
    for layer in rest:
        if layer.in_features == width:
            return layer
    if parent is None:
        return None
    siblings = list(parent.children())
    after = siblings[siblings.index(module) + 1 :] if module in siblings else []
    for sibling in after:
        for layer in sibling.modules():
            if isinstance(layer, nn.Linear):
                return layer if layer.in_features == width else None
    return None


@HEAD_ADAPTERS.register(
    "qkv_linears",
    "separate Q/K/V Linears with a head count attribute and an output projection found from the "
    "structure (HuggingFace BERT, RoBERTa, ELECTRA, DistilBERT, MPNet, ALBERT, ...)",
)
def qkv_linear_attention(module: nn.Module, parent: nn.Module | None = None) -> HeadSite | None:
    """Any attention with three same-shaped Q/K/V Linear children and a head count attribute."""
    heads = _int_attr(module, HEAD_COUNT_ATTRS)
    found = _qkv_and_rest(module)
    if heads is None or heads < 1 or found is None:
        return None
    (q, k, v), rest = found
    width = q.out_features
    size = _int_attr(module, HEAD_SIZE_ATTRS) or width // heads
    if heads * size != width:
        return None
    out = _output_projection(module, parent, rest, width)
    if out is None:
        return None

    def set_heads(n: int) -> None:
        for attr in HEAD_COUNT_ATTRS:
            if _int_attr(module, (attr,)) is not None:
                setattr(module, attr, n)
        if _int_attr(module, ("all_head_size",)) is not None:
            module.all_head_size = n * size

    return HeadSite(module, (q, k, v), out, size, set_heads)


def head_sites(model: nn.Module) -> dict[str, HeadSite]:
    """Every attention layer of `model` that an adapter recognises, by module name.

    Raises:
        PruneOpsError: A module looks like attention (a head count and Q/K/V-like Linears) but no
            adapter understands it: pruning it channel by channel would break its heads.
    """
    sites: dict[str, HeadSite] = {}
    parents: dict[int, nn.Module] = {}
    for name, module in model.named_modules():
        for child in module.children():
            parents[id(child)] = module
        for entry in HEAD_ADAPTERS:
            site = entry.obj(module, parents.get(id(module)))
            if site is not None:
                sites[name] = site
                break
        else:
            if looks_like_attention(module):
                known = ", ".join(HEAD_ADAPTERS.names())
                raise PruneOpsError(
                    f"{name or 'the model'} ({type(module).__name__}) looks like attention (a head count and "
                    f"Q/K/V-like Linears) but no attention adapter understands it ({known}); "
                    "PruneOps will not prune inside it channel by channel: register an adapter in "
                    "pruneops.pruning.heads.HEAD_ADAPTERS"
                )
    return sites


@dataclass
class HeadTie:
    """Attention layers that must lose the same heads, and the tensors indexed by head they share.

    MPNet computes one relative-position bias with a column per head and adds it in every layer:
    head h of every layer reads column h, so heads are removed from all layers at once.
    """

    sites: tuple[str, ...]
    tensors: tuple[tuple[nn.Module, str, int], ...]
    set_num_heads: Callable[[int], None]


TieAdapter = Callable[[str, nn.Module, dict[str, HeadSite]], "HeadTie | None"]
TIE_ADAPTERS: Registry[TieAdapter] = Registry("head tie adapter")


@TIE_ADAPTERS.register("mpnet_relative_bias", "MPNet's encoder: one relative-position bias column per head, all layers")
def mpnet_relative_bias(name: str, module: nn.Module, sites: dict[str, HeadSite]) -> HeadTie | None:
    """An encoder with `relative_attention_bias` (Embedding, one column per head) and `n_heads`."""
    bias = getattr(module, "relative_attention_bias", None)
    heads = _int_attr(module, ("n_heads",))
    if not isinstance(bias, nn.Embedding) or heads is None or bias.embedding_dim != heads:
        return None
    prefix = f"{name}." if name else ""
    members = tuple(s for s in sites if s.startswith(prefix))
    if not members:
        return None

    def set_heads(n: int) -> None:
        module.n_heads = n
        bias.embedding_dim = n

    return HeadTie(members, ((bias, "weight", 1),), set_heads)


def head_ties(model: nn.Module, sites: dict[str, HeadSite]) -> dict[str, HeadTie]:
    """Groups of `sites` that must lose the same heads, by the name of the module that ties them.

    Raises:
        PruneOpsError: The tied layers do not have the same number of heads.
    """
    ties: dict[str, HeadTie] = {}
    for name, module in model.named_modules():
        for entry in TIE_ADAPTERS:
            tie = entry.obj(name, module, sites)
            if tie is None:
                continue
            counts = {sites[s].num_heads for s in tie.sites}
            if len(counts) != 1:
                raise PruneOpsError(f"{name}: its layers share one bias per head but have {sorted(counts)} heads")
            ties[name] = tie
            break
    return ties


def attention_calls(model: nn.Module, sites: dict[str, HeadSite], run: Callable[[], object]) -> dict[str, int]:
    """How many times each site's attention runs in one call of `run` (one forward of `model`)."""
    counts = dict.fromkeys(sites, 0)
    handles = []
    for name, site in sites.items():

        def hook(*_: object, name: str = name) -> None:
            counts[name] += 1

        handles.append(site.projections[0].register_forward_hook(hook))
    try:
        with torch.no_grad():
            run()
    finally:
        for h in handles:
            h.remove()
    return counts


def refuse_shared_attention(model: nn.Module, sites: dict[str, HeadSite], run: Callable[[], object]) -> None:
    """Refuses a model whose attention weights serve several layers (ALBERT's shared layers).

    Removing a head there removes it from every layer that shares the weights, and the per-layer
    head counts of sensitivity and allocation would not describe the model.

    Raises:
        PruneOpsError: Some attention module runs more than once per forward.
    """
    shared = {n: c for n, c in attention_calls(model, sites, run).items() if c > 1}
    if shared:
        name, calls = next(iter(shared.items()))
        raise PruneOpsError(
            f"attention {name} runs {calls} times per forward (its weights are shared by several layers, "
            f"as in ALBERT): PruneOps cannot prune heads or channels of shared attention layers; "
            f"{len(shared)} such module(s)"
        )


@torch.no_grad()
def remove_heads_(site: HeadSite, heads: Iterable[int]) -> None:
    """Physically removes `heads`: slices Q/K/V rows and output columns, updates the count."""
    drop = set(heads)
    keep = [h for h in range(site.num_heads) if h not in drop]
    if not keep:
        raise PruneOpsError(
            f"cannot remove all {site.num_heads} heads of {type(site.module).__name__}: a layer keeps at least one head"
        )
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


@torch.no_grad()
def remove_tied_heads_(tie: HeadTie, sites: dict[str, HeadSite], heads: Iterable[int]) -> None:
    """Removes the same `heads` from every layer of `tie` and from the tensors they share."""
    drop = sorted(set(heads))
    for name in tie.sites:
        remove_heads_(sites[name], drop)
    for module, attr, dim in tie.tensors:
        tensor = getattr(module, attr)
        keep = torch.tensor([h for h in range(tensor.shape[dim]) if h not in drop], dtype=torch.long)
        setattr(module, attr, nn.Parameter(tensor.index_select(dim, keep).clone()))
    tie.set_num_heads(sites[tie.sites[0]].num_heads)


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
        sites: The attention layers to score (none: an empty result).
        batches: (inputs, labels) pairs.
        forward: Maps (model, inputs) to logits; default `model(inputs)` (`model(**inputs)` if named).
    """
    if not sites:
        return {}
    forward = forward or run_model
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
