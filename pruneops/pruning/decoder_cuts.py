"""Structured pruning of decoder LLMs: MLP neurons, attention heads by KV group, whole layers.

Every cut keeps shapes uniform across layers (one MLP width, one head count), so the config
expresses the pruned model and every runtime that reads configs loads it. Quality without
retraining comes from two things measured on calibration text:

- importance from activations: a neuron (or head) matters by how large its input to the
  consuming projection is times how large that projection's weights for it are (Wanda/FLAP);
  plain weight magnitude is the baseline criterion;
- reconstruction: after a cut, the consuming projection (MLP down, attention output) is re-solved
  in closed form, by least squares on the calibration inputs, to reproduce the dense layer's
  output from the kept features (plus the mean of the removed ones into its bias where it has one).

Both read one statistic per consuming projection: the Gram matrix of its inputs over the
calibration tokens, gathered in one forward pass (`calibrate`). Depth cuts rank layers by block
influence (ShortGPT): one minus the mean cosine similarity between a layer's input and output.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from torch import nn

from pruneops.core.errors import ConfigError
from pruneops.core.plugins import Registry
from pruneops.core.progress import Progress
from pruneops.models.decoder_layout import DecoderLayout, get_module, layout_of, weight_out_in
from pruneops.models.decoders import keep_inputs_, keep_outputs_, remove_layers_, set_weight_out_in_
from pruneops.models.decoders import mlp_width as current_mlp_width

RIDGE = 1e-3  # ridge of the least-squares solve, relative to the mean input energy


@dataclass
class ProjectionInputs:
    """Second-order statistics of one projection's inputs over the calibration tokens."""

    gram: torch.Tensor  # (in, in), float64: sum of x x^T
    total: torch.Tensor  # (in,), float64: sum of x
    count: int = 0

    def add(self, x: torch.Tensor) -> None:
        """Accumulates a batch of inputs (..., in)."""
        flat = x.reshape(-1, x.shape[-1]).double()
        self.gram += flat.T @ flat
        self.total += flat.sum(0)
        self.count += flat.shape[0]

    @property
    def energy(self) -> torch.Tensor:
        """Mean squared input per feature."""
        return self.gram.diagonal() / max(self.count, 1)

    @property
    def variance(self) -> torch.Tensor:
        """Variance of each input feature (FLAP's fluctuation)."""
        mean = self.total / max(self.count, 1)
        return (self.energy - mean.pow(2)).clamp_min(0)


@dataclass
class Calibration:
    """What one calibration pass measured, per decoder layer."""

    mlp: list[ProjectionInputs]
    attention_output: list[ProjectionInputs | None]
    block_influence: list[float]
    tokens: int = 0
    extra: dict = field(default_factory=dict)


def calibrate(model: nn.Module, blocks: torch.Tensor, batch_size: int = 4, attention: bool = True) -> Calibration:
    """One forward pass over calibration token blocks, recording the statistics pruning needs.

    Args:
        model: A causal LM of a registered layout.
        blocks: (n, length) int64 token ids.
        batch_size: Blocks per forward pass.
        attention: Also gather the attention output projection's inputs (layouts with separate
            q/k/v/o projections only).
    """
    layout = layout_of(model)
    layers = layout.decoder_layers(model)
    stats = Calibration(mlp=[], attention_output=[], block_influence=[0.0] * len(layers))
    similarity = [0.0] * len(layers)
    handles = []
    for index, layer in enumerate(layers):
        _, down = layout.mlp_modules(layer)
        width = weight_out_in(down).shape[1]
        stats.mlp.append(
            ProjectionInputs(torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64))
        )
        handles.append(down.register_forward_pre_hook(_gather(stats.mlp[-1])))
        if attention and layout.attention is not None and layout.head_dim_key is not None:
            o = layout.attention_modules(layer)[3]
            width = weight_out_in(o).shape[1]
            stats.attention_output.append(
                ProjectionInputs(
                    torch.zeros(width, width, dtype=torch.float64), torch.zeros(width, dtype=torch.float64)
                )
            )
            handles.append(o.register_forward_pre_hook(_gather(stats.attention_output[-1])))
        else:
            stats.attention_output.append(None)
        handles.append(layer.register_forward_hook(_similarity(similarity, index), with_kwargs=True))
    try:
        with torch.inference_mode(), Progress("calibration", len(blocks), "blocks") as counter:
            for start in range(0, len(blocks), batch_size):
                model(input_ids=blocks[start : start + batch_size], use_cache=False)
                counter.update(len(blocks[start : start + batch_size]))
    finally:
        for handle in handles:
            handle.remove()
    stats.tokens = int(blocks.numel())
    stats.block_influence = [1.0 - s / max(stats.tokens, 1) for s in similarity]
    return stats


def _gather(target: ProjectionInputs) -> Callable:
    def hook(module: nn.Module, args: tuple) -> None:
        target.add(args[0].detach())

    return hook


def _similarity(totals: list[float], index: int) -> Callable:
    def hook(module: nn.Module, args: tuple, kwargs: dict, output: object) -> None:
        hidden_in = args[0] if args else kwargs["hidden_states"]
        hidden_out = output[0] if isinstance(output, tuple) else output
        cos = nn.functional.cosine_similarity(hidden_in.double(), hidden_out.double(), dim=-1)
        totals[index] += float(cos.sum())

    return hook


# ---------------------------------------------------------------- importance of MLP neurons


NeuronScore = Callable[[list[torch.Tensor], torch.Tensor, ProjectionInputs], torch.Tensor]
NEURON_IMPORTANCES: Registry[NeuronScore] = Registry("decoder neuron importance")


@NEURON_IMPORTANCES.register("magnitude", "L2 norm of the neuron's weights in every coupled projection (no data)")
def _magnitude(inputs: list[torch.Tensor], output: torch.Tensor, stats: ProjectionInputs) -> torch.Tensor:
    score = output.pow(2).sum(0)
    for weight in inputs:
        score = score + weight.pow(2).sum(1)
    return score.sqrt()


@NEURON_IMPORTANCES.register("activation", "input norm on calibration text x output-weight norm (Wanda)")
def _activation(inputs: list[torch.Tensor], output: torch.Tensor, stats: ProjectionInputs) -> torch.Tensor:
    return stats.energy.float().sqrt() * output.pow(2).sum(0).sqrt()


@NEURON_IMPORTANCES.register("fluctuation", "input variance on calibration text x squared output-weight norm (FLAP)")
def _fluctuation(inputs: list[torch.Tensor], output: torch.Tensor, stats: ProjectionInputs) -> torch.Tensor:
    return stats.variance.float() * output.pow(2).sum(0)


# ---------------------------------------------------------------- cuts


def least_squares_(module: nn.Module, stats: ProjectionInputs, keep: torch.Tensor) -> None:
    """Re-solves a projection on its kept inputs to reproduce its dense output on calibration data.

    Minimises ||X_keep W'^T + b' - (X W^T + b)||^2 over the calibration inputs X, in closed form
    from their Gram matrix (`W'^T = G_kk^-1 G_k: W^T`, ridge-regularised); a projection with a bias
    also solves for the bias (the mean contribution of the removed inputs moves into it).
    Call before slicing the module's inputs.
    """
    weight = weight_out_in(module).double()  # (out, in)
    has_bias = getattr(module, "bias", None) is not None
    gram, total, n = stats.gram, stats.total, max(stats.count, 1)
    if has_bias:  # augment the inputs with a constant 1
        full = torch.zeros(gram.shape[0] + 1, gram.shape[0] + 1, dtype=torch.float64)
        full[:-1, :-1], full[:-1, -1], full[-1, :-1], full[-1, -1] = gram, total, total, n
        gram = full
        rows = torch.cat([keep, torch.tensor([gram.shape[0] - 1])])
    else:
        rows = keep
    target = gram[rows][:, : weight.shape[1]] @ weight.T  # G_k: W^T, (k, out)
    system = gram[rows][:, rows]
    ridge = RIDGE * float(system.diagonal().mean())
    solution = torch.linalg.solve(system + ridge * torch.eye(len(rows), dtype=torch.float64), target)
    new_weight = torch.zeros_like(weight)
    new_weight[:, keep] = solution[: len(keep)].T
    set_weight_out_in_(module, new_weight.to(module.weight.dtype))
    if has_bias:
        module.bias.data += solution[-1].to(module.bias.dtype)


def prune_mlp_(
    model: nn.Module,
    keep_width: int,
    calibration: Calibration | None,
    importance: str = "activation",
    reconstruct: bool = True,
) -> None:
    """Keeps `keep_width` MLP neurons in every layer (gate, up and down coupled).

    Raises:
        ConfigError: The width is out of range, or data-driven choices lack a calibration.
    """
    layout = layout_of(model)
    if layout.mlp_width_key is None:  # refused before anything is sliced
        raise ConfigError(
            f"prune: MLP neurons of {layout.name} models cannot be cut: no config key expresses the width"
        )
    score = NEURON_IMPORTANCES.get(importance)
    if (importance != "magnitude" or reconstruct) and calibration is None:
        raise ConfigError(f"prune: importance {importance!r} and reconstruction need a calibration pass")
    for index, layer in enumerate(layout.decoder_layers(model)):
        inputs, down = layout.mlp_modules(layer)
        width = weight_out_in(down).shape[1]
        if not 0 < keep_width <= width:
            raise ConfigError(f"prune: MLP width {keep_width} is outside 1..{width}")
        stats = calibration.mlp[index] if calibration is not None else None
        producers = [chunk for m in inputs for chunk in weight_out_in(m).split(width)]  # a fused gate_up: 2 chunks
        scores = score(producers, weight_out_in(down), stats)
        keep = scores.topk(keep_width).indices.sort().values
        if reconstruct:
            least_squares_(down, stats, keep)
        stacked = torch.cat([keep + chunk * width for chunk in range(layout.mlp_chunks)])
        for module in inputs:
            keep_outputs_(module, stacked)
        keep_inputs_(down, keep)
    setattr(model.config, layout.mlp_width_key, keep_width)


def head_group_scores(
    layout: DecoderLayout, layer: nn.Module, stats: ProjectionInputs | None, heads: int
) -> torch.Tensor:
    """Per query head: input energy of its output-projection slice x that slice's weight norm."""
    o = weight_out_in(layout.attention_modules(layer)[3])
    per_feature = o.pow(2).sum(0)
    if stats is not None:
        per_feature = per_feature * stats.energy.float()
    return per_feature.reshape(heads, -1).sum(1)


def prune_heads_(
    model: nn.Module,
    keep_kv_groups: int,
    keep_queries_per_group: int,
    calibration: Calibration | None,
    reconstruct: bool = True,
) -> None:
    """Keeps whole KV groups and query heads within each (uniform in every layer).

    A KV group is one key/value head and the query heads that read it (grouped-query
    attention); removing a group removes its k/v rows, its query rows and their slice of the
    output projection, and the cache shrinks with it.

    Raises:
        ConfigError: The layout cannot express fewer heads, or the counts are out of range.
    """
    layout = layout_of(model)
    layout.attention_modules(layout.decoder_layers(model)[0])  # refuses a layout that cannot express fewer heads
    config = model.config
    heads = getattr(config, layout.heads_key)
    kv = getattr(config, layout.kv_heads_key) if layout.kv_heads_key else heads
    head_dim = weight_out_in(layout.attention_modules(layout.decoder_layers(model)[0])[0]).shape[0] // heads
    per_group = heads // kv
    if not (0 < keep_kv_groups <= kv and 0 < keep_queries_per_group <= per_group):
        raise ConfigError(
            f"prune: heads keep {keep_kv_groups}/{kv} KV groups and {keep_queries_per_group}/{per_group} queries each"
        )
    for index, layer in enumerate(layout.decoder_layers(model)):
        q, k, v, o = layout.attention_modules(layer)
        stats = calibration.attention_output[index] if calibration is not None else None
        scores = head_group_scores(layout, layer, stats, heads).reshape(kv, per_group)
        groups = scores.sum(1).topk(keep_kv_groups).indices.sort().values
        queries = scores[groups].topk(keep_queries_per_group, dim=1).indices.sort(dim=1).values
        query_heads = (groups[:, None] * per_group + queries).reshape(-1)
        q_rows = (query_heads[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
        kv_rows = (groups[:, None] * head_dim + torch.arange(head_dim)).reshape(-1)
        if reconstruct and stats is not None:
            least_squares_(o, stats, q_rows)
        keep_outputs_(q, q_rows)
        keep_outputs_(k, kv_rows)
        keep_outputs_(v, kv_rows)
        keep_inputs_(o, q_rows)
        for path in layout.query_norms:  # norms over the whole query (OLMo-2): sliced with it
            _keep_norm_(get_module(layer, path), q_rows)
        for path in layout.key_norms:
            _keep_norm_(get_module(layer, path), kv_rows)
    setattr(config, layout.heads_key, keep_kv_groups * keep_queries_per_group)
    if layout.kv_heads_key:
        setattr(config, layout.kv_heads_key, keep_kv_groups)
    setattr(config, layout.head_dim_key, head_dim)  # explicit: hidden / heads no longer gives it


def _keep_norm_(norm: nn.Module, index: torch.Tensor) -> None:
    norm.weight = nn.Parameter(norm.weight.data[index].contiguous())
    if getattr(norm, "bias", None) is not None:
        norm.bias = nn.Parameter(norm.bias.data[index].contiguous())
    for attr in ("normalized_shape", "hidden_size"):
        if isinstance(getattr(norm, attr, None), tuple):
            setattr(norm, attr, (len(index),))


def least_influential_layers(calibration: Calibration, count: int) -> list[int]:
    """The `count` layers whose output is most like their input (lowest block influence)."""
    order = sorted(range(len(calibration.block_influence)), key=lambda i: calibration.block_influence[i])
    return sorted(order[:count])


def drop_layers_(model: nn.Module, calibration: Calibration, count: int) -> list[int]:
    """Removes the `count` least influential decoder layers; returns their indices."""
    if count <= 0:
        return []
    drop = least_influential_layers(calibration, count)
    remove_layers_(model, drop)
    return drop


def rebuild(model: nn.Module) -> nn.Module:
    """The pruned model rebuilt from its config and loaded strictly: proof that the config expresses it."""
    from transformers import AutoModelForCausalLM

    fresh = AutoModelForCausalLM.from_config(model.config, dtype=torch.float32)
    fresh.load_state_dict(model.state_dict(), strict=True)
    return fresh.eval()


def prune_to_shape_(
    model: nn.Module,
    layers: int,
    mlp_width: int,
    kv_groups: int,
    queries_per_group: int,
    calibration: Calibration | None,
    importance: str = "activation",
    reconstruct: bool = True,
    layer_order: list[int] | None = None,
) -> list[int]:
    """Cuts a causal LM to a uniform shape: heads, then MLP neurons, then the least influential layers.

    Every cut reads the one calibration pass of the unpruned model (layers are dropped last, so
    its per-layer statistics still index the layers they were gathered on). `layer_order` (layer
    indices, the first removed first: e.g. ranked by measured perplexity increase) replaces the
    block-influence ranking of the depth cut.

    Returns:
        The indices (in the unpruned model) of the layers removed.

    Raises:
        ConfigError: A shape wider than the model, or a cut the layout cannot express.
    """
    layout = layout_of(model)
    config = model.config
    heads = getattr(config, layout.heads_key)
    dense_groups = getattr(config, layout.kv_heads_key) if layout.kv_heads_key else heads
    if (kv_groups, queries_per_group) != (dense_groups, heads // dense_groups):
        prune_heads_(model, kv_groups, queries_per_group, calibration, reconstruct)
    if mlp_width != current_mlp_width(model):
        prune_mlp_(model, mlp_width, calibration, importance, reconstruct)
    dropped = len(layout.decoder_layers(model)) - layers
    if dropped < 0:
        raise ConfigError(f"prune: {layers} layers is more than the model's {len(layout.decoder_layers(model))}")
    if dropped and layer_order is not None:
        drop = sorted(layer_order[:dropped])
        remove_layers_(model, drop)
        return drop
    if dropped and calibration is None:
        raise ConfigError("prune: a depth cut ranks layers by block influence and needs a calibration pass")
    return drop_layers_(model, calibration, dropped) if dropped else []
