"""Where a causal LM keeps what decoder pruning cuts, read from the model itself.

A `DecoderLayout` names the decoder-layer list, each layer's MLP projections (producing and
consuming the hidden neurons, a fused gate/up included) and attention projections (q/k/v/o,
or one fused qkv), the norms that follow the query and key widths, and which config keys express
each width. It is derived from any causal LM transformers builds — no per-family table — by:

1. the `ModuleList` with as many modules as the config has layers, every one alike;
2. in a layer, the projections (Linear or GPT-2's Conv1D) inside the attention block and outside
   it: outside, those reading the hidden size produce the MLP's neurons, the one writing it back
   consumes them; inside, names and shapes give q/k/v/o or a fused qkv;
3. a probe of the config: a copy with a narrower MLP, fewer layers or fewer heads is built on the
   meta device (no memory, no weights) and must have the narrower modules. A width no config key
   expresses cannot be cut, and cuts of it are refused naming it.

What cannot be handled is refused in one line at `train`, the first stage that loads the model:
no such list, layers that differ (per-layer widths, hybrid or mixture-of-experts layers), an MLP
with no single consuming projection.
"""

from __future__ import annotations

import copy
import re
import weakref
from dataclasses import dataclass, field

import torch
from torch import nn

from pruneops.core.errors import ConfigError

# Last name component of attention projections, by role (a name is read only when shapes tie).
_Q, _K, _V = (
    ("q_proj", "query", "q", "wq", "q_lin"),
    ("k_proj", "key", "k", "wk", "k_lin"),
    ("v_proj", "value", "v", "wv", "v_lin"),
)
_O = ("o_proj", "out_proj", "dense", "c_proj", "o", "wo", "out_lin", "proj")
_FUSED_QKV = ("qkv_proj", "query_key_value", "c_attn", "wqkv", "qkv", "w_pack")
_MOE_PATH = re.compile(r"^(experts?|shared_experts?|router|moe|block_sparse_moe)$", re.IGNORECASE)
_MOE_CLASS = re.compile(r"(Sparse|MoE|Moe)(Block|MLP|Layer)|Experts?$|Router$")
PER_LAYER_KEYS = ("layer_types",)  # config lists with one entry per decoder layer (sliding/full attention)
_WIDTH_KEY_HINT = re.compile(r"inter|ffn|inner|d_ff|mlp|ff_dim|feed_forward", re.IGNORECASE)


@dataclass(frozen=True)
class DecoderLayout:
    """Where one causal LM keeps what decoder pruning cuts, and which config keys express the cuts.

    Args:
        name: The model's `model_type` (what refusals and reports call it).
        layers: Attribute path from the `*ForCausalLM` model to the `ModuleList` of decoder layers.
        mlp_inputs: Per layer, the projections that produce the MLP's hidden neurons (gate and up).
        mlp_output: Per layer, the projection that consumes them (down).
        mlp_width_key: Config key of the MLP width (None: no key expresses it; the MLP cannot be cut).
        layers_key: Config key of the layer count.
        attention: Per layer, `(q, k, v, o)` projection paths; None where the family fuses them.
        heads_key: Config key of the query head count.
        kv_heads_key: Config key of the key/value head count (None: as many as query heads).
        head_dim_key: Config key of the head size (None: heads cannot be cut, e.g. derived from hidden / heads).
        mlp_chunks: How many neuron-producing matrices a fused producer stacks (Phi-3's gate_up: 2).
        query_norms: Per layer, norms over the whole query width (sliced with the query heads).
        key_norms: Per layer, norms over the whole key width (sliced with the KV groups).
        cannot_cut: What this model's config cannot express, one phrase each (said when such a cut is asked).
    """

    name: str
    layers: str
    mlp_inputs: tuple[str, ...]
    mlp_output: str
    mlp_width_key: str | None
    layers_key: str
    attention: tuple[str, str, str, str] | None = None
    heads_key: str = "num_attention_heads"
    kv_heads_key: str | None = "num_key_value_heads"
    head_dim_key: str | None = "head_dim"
    mlp_chunks: int = 1
    query_norms: tuple[str, ...] = ()
    key_norms: tuple[str, ...] = ()
    cannot_cut: tuple[str, ...] = field(default=())

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's decoder layers."""
        return get_module(model, self.layers)

    def mlp_modules(self, layer: nn.Module) -> tuple[list[nn.Module], nn.Module]:
        """A layer's neuron-producing projections and the projection that consumes the neurons."""
        return [get_module(layer, p) for p in self.mlp_inputs], get_module(layer, self.mlp_output)

    def attention_modules(self, layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """A layer's q, k, v and o projections.

        Raises:
            ConfigError: The family fuses them or its config cannot express fewer heads.
        """
        if self.attention is None or self.head_dim_key is None:
            why = "; ".join(c for c in self.cannot_cut if "head" in c) or "its config cannot express fewer heads"
            raise ConfigError(
                f"prune: attention heads of {self.name} models cannot be cut: {why} (cut MLP neurons or layers)"
            )
        return self.attention_modules_unchecked(layer)

    def attention_modules_unchecked(self, layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """A layer's q, k, v and o projections, whether or not the config can express fewer heads."""
        q, k, v, o = (get_module(layer, p) for p in self.attention or ())
        return q, k, v, o

    def describe(self) -> str:
        """One line: what can be cut and what cannot."""
        can = ["layers"]
        if self.mlp_width_key:
            can.append(f"MLP neurons ({self.mlp_width_key})")
        if self.attention is not None and self.head_dim_key is not None:
            can.append("attention heads by KV group")
        cannot = f"; cannot cut: {'; '.join(self.cannot_cut)}" if self.cannot_cut else ""
        return f"{self.name}: can cut {', '.join(can)}{cannot}"


def get_module(root: nn.Module, path: str) -> nn.Module:
    """The submodule at a dotted attribute path (ModuleList indices included).

    Raises:
        ConfigError: Nothing at that path.
    """
    module = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise ConfigError(f"decoder layout: {type(root).__name__} has no {path!r}")
        module = getattr(module, part)
    return module


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """A projection's weight as (out, in), whatever its module stores."""
    return module.weight.data.t() if type(module).__name__ == "Conv1D" else module.weight.data


_CACHE: weakref.WeakKeyDictionary[nn.Module, DecoderLayout] = weakref.WeakKeyDictionary()


def layout_of(model: nn.Module) -> DecoderLayout:
    """The layout of a causal LM, derived from its modules and probed config (once per model object).

    Raises:
        ConfigError: What this model has that decoder pruning cannot handle, in one line.
    """
    layout = _CACHE.get(model)
    if layout is None:
        layout = derive_layout(model)
        _CACHE[model] = layout
    return layout


_MLP_MATRICES: dict[str, int] = {}


def mlp_matrices(config: object) -> int:
    """Weight matrices a decoder layer's MLP holds per neuron, read from the layout a config builds.

    Gate, up and down (Llama, Qwen; Phi-3's fused gate_up counts two): 3; a plain MLP (GPT-2,
    GPT-NeoX, Phi, Nemotron): 2. Read once per config from a one-layer copy built on the meta device.

    Raises:
        ConfigError: The config builds a layout decoder pruning cannot handle.
    """
    key = config.to_json_string()
    if key not in _MLP_MATRICES:
        from transformers import AutoModelForCausalLM

        probe = copy.deepcopy(config)
        for name, value in first_layers(config, 1).items():
            setattr(probe, name, value)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(probe)
        layout = derive_layout(model)
        _MLP_MATRICES[key] = len(layout.mlp_inputs) * layout.mlp_chunks + 1
    return _MLP_MATRICES[key]


def derive_layout(model: nn.Module) -> DecoderLayout:
    """Reads the layout from the model (see the module docstring).

    Raises:
        ConfigError: No decoder-layer list, layers that differ, a mixture-of-experts MLP, or an MLP
            without one consuming projection.
    """
    config = getattr(model, "config", None)
    model_type = getattr(config, "model_type", None) or type(model).__name__
    layers_path, layers = _layer_list(model, model_type)
    projections = _projections(layers[0])
    _refuse_differing_layers(layers, projections, model_type)
    _refuse_experts(layers[0], model_type)
    hidden = _hidden_size(model, config)
    attention_block = _attention_block(layers[0], model_type)
    inside = {p: m for p, m in projections.items() if p.startswith(attention_block + ".")}
    outside = {p: m for p, m in projections.items() if p not in inside}
    mlp_inputs, mlp_output, chunks = _mlp(outside, hidden, model_type)
    attention, cannot = _attention(inside, config, hidden)
    width = weight_out_in(get_module(layers[0], mlp_output)).shape[1]
    layout = DecoderLayout(
        name=str(model_type),
        layers=layers_path,
        mlp_inputs=mlp_inputs,
        mlp_output=mlp_output,
        mlp_width_key=None,
        layers_key="num_hidden_layers",
        attention=attention,
        kv_heads_key="num_key_value_heads" if getattr(config, "num_key_value_heads", None) else None,
        head_dim_key="head_dim" if attention is not None else None,
        mlp_chunks=chunks,
        query_norms=_norms(layers[0], attention_block, "q", config, attention),
        key_norms=_norms(layers[0], attention_block, "k", config, attention),
    )
    return _probe_config(model, layout, width, cannot)


def _layer_list(model: nn.Module, model_type: str) -> tuple[str, nn.ModuleList]:
    count = getattr(getattr(model, "config", None), "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) == count and count:
            return path, module
    raise ConfigError(
        f"train.pretrained: {model_type} is not a decoder PruneOps can cut: no list of {count} decoder layers "
        "(config.num_hidden_layers) among its modules"
    )


def _projections(layer: nn.Module) -> dict[str, nn.Module]:
    return {
        path: module
        for path, module in layer.named_modules()
        if isinstance(module, nn.Linear) or type(module).__name__ == "Conv1D"
    }


def _signature(layer: nn.Module) -> list[tuple[str, tuple[int, ...]]]:
    return [(p, tuple(m.weight.shape)) for p, m in _projections(layer).items()]


def _refuse_differing_layers(layers: nn.ModuleList, first: dict[str, nn.Module], model_type: str) -> None:
    reference = [(p, tuple(m.weight.shape)) for p, m in first.items()]
    for index, layer in enumerate(layers):
        signature = _signature(layer)
        if signature != reference:
            differs = sorted({p for p, _ in signature} ^ {p for p, _ in reference}) or [
                p for (p, s), (_, r) in zip(signature, reference, strict=False) if s != r
            ]
            raise ConfigError(
                f"train.pretrained: {model_type}: decoder layer {index} differs from layer 0 "
                f"({', '.join(differs[:3]) or 'projection count'}): per-layer widths or hybrid layers "
                "cannot be cut to one uniform shape that a config expresses"
            )


def _refuse_experts(layer: nn.Module, model_type: str) -> None:
    for path, module in layer.named_modules():
        if path and (_MOE_PATH.match(path.rsplit(".", 1)[-1]) or _MOE_CLASS.search(type(module).__name__)):
            raise ConfigError(
                f"train.pretrained: {model_type} routes tokens to experts ({path}: {type(module).__name__}); "
                "decoder pruning cuts dense MLPs only"
            )


def _hidden_size(model: nn.Module, config: object) -> int:
    hidden = getattr(config, "hidden_size", None)
    if hidden is None:
        hidden = model.get_input_embeddings().weight.shape[1]
    return int(hidden)


def _attention_block(layer: nn.Module, model_type: str) -> str:
    children = [(path, module) for path, module in layer.named_children() if _projections(module)]
    for named in (lambda p, m: re.search("attention|attn", type(m).__name__, re.IGNORECASE),
                  lambda p, m: re.search("attention|attn", p, re.IGNORECASE)):  # fmt: skip
        for path, module in children:
            if named(path, module):
                return path
    raise ConfigError(f"train.pretrained: {model_type}: no attention block in a decoder layer (hybrid layers?)")


def _mlp(outside: dict[str, nn.Module], hidden: int, model_type: str) -> tuple[tuple[str, ...], str, int]:
    shapes = {p: tuple(weight_out_in(m).shape) for p, m in outside.items()}  # (out, in)
    consumers = [p for p, (o, i) in shapes.items() if o == hidden and i != hidden]
    if len(consumers) != 1:
        raise ConfigError(
            f"train.pretrained: {model_type}: the MLP has {len(consumers)} projections writing the hidden size "
            f"back ({', '.join(consumers) or 'none'} among {', '.join(shapes) or 'no projections'}); "
            "decoder pruning needs exactly one"
        )
    width = shapes[consumers[0]][1]
    producers = [p for p, (o, i) in shapes.items() if i == hidden and o % width == 0 and p != consumers[0]]
    chunks = {shapes[p][0] // width for p in producers}
    if not producers or len(chunks) != 1:
        raise ConfigError(
            f"train.pretrained: {model_type}: no projection of the MLP produces its {width} neurons "
            f"(projections outside attention: {shapes})"
        )
    return tuple(producers), consumers[0], chunks.pop()


def _role(path: str, names: tuple[str, ...]) -> bool:
    return path.rsplit(".", 1)[-1].lower() in names


def _attention(
    inside: dict[str, nn.Module], config: object, hidden: int
) -> tuple[tuple[str, str, str, str] | None, list[str]]:
    fused = [p for p in inside if _role(p, _FUSED_QKV)]
    if fused:
        return None, [f"heads: q/k/v are fused in {fused[0]}"]
    roles = []
    for names in (_Q, _K, _V, _O):
        found = [p for p in inside if _role(p, names)]
        if len(found) != 1:
            return None, [f"heads: no single {names[0]} among the attention's {', '.join(inside) or 'projections'}"]
        roles.append(found[0])
    q, k, v, o = (tuple(weight_out_in(inside[p]).shape) for p in roles)
    if not (q[1] == k[1] == v[1] == hidden and o[0] == hidden and o[1] == q[0] and k == v):
        return None, [f"heads: attention shapes q{q} k{k} v{v} o{o} are not separate projections of the hidden size"]
    return (roles[0], roles[1], roles[2], roles[3]), []


def _norms(
    layer: nn.Module, block: str, which: str, config: object, attention: tuple[str, ...] | None
) -> tuple[str, ...]:
    """Norms inside the attention block whose weight spans the whole query (or key) width."""
    if attention is None:
        return ()
    index = 0 if which == "q" else 1
    width = weight_out_in(get_module(layer, attention[index])).shape[0]
    found = []
    for path, module in get_module(layer, block).named_modules():
        weight = getattr(module, "weight", None)
        name = path.rsplit(".", 1)[-1].lower()
        spans = weight is not None and weight.dim() == 1 and weight.shape[0] == width
        if path and "norm" in name and name.startswith(which) and spans and width != getattr(config, "head_dim", None):
            found.append(f"{block}.{path}")
    return tuple(found)


# ---------------------------------------------------------------- probing the config


def _build_on_meta(model: nn.Module, config: object, changes: dict) -> nn.Module | None:
    """The model built on the meta device from a copy of its config with `changes` (None: it cannot be)."""
    probe_config = copy.deepcopy(config)
    try:
        for key, value in changes.items():
            setattr(probe_config, key, value)
        with torch.device("meta"):
            return type(model)(probe_config)
    except Exception:  # noqa: BLE001 - any failure means the config cannot express the change
        return None


def _probe_config(model: nn.Module, layout: DecoderLayout, width: int, cannot: list[str]) -> DecoderLayout:
    cannot = list(cannot)
    width_key = _probe_width_key(model, layout, width)
    if width_key is None:
        cannot.append(f"MLP neurons: no config key builds a narrower {layout.mlp_output}")
    if not _probe_layers(model, layout):
        raise ConfigError(
            f"train.pretrained: {layout.name}: a config with fewer num_hidden_layers builds no fewer decoder layers"
        )
    head_dim_key = layout.head_dim_key
    if layout.attention is not None and not _probe_heads(model, layout):
        head_dim_key = None
        cannot.append("heads: its config cannot express fewer heads with the same head size")
    return _replace(layout, mlp_width_key=width_key, head_dim_key=head_dim_key, cannot_cut=tuple(cannot))


def first_layers(config: object, count: int) -> dict:
    """Config changes that keep the first `count` decoder layers: every per-layer list, then the count."""
    changes: dict = {}
    for key in PER_LAYER_KEYS:
        values = getattr(config, key, None)
        if isinstance(values, list) and len(values) == config.num_hidden_layers:
            changes[key] = values[:count]
    return {**changes, "num_hidden_layers": count}


def _replace(layout: DecoderLayout, **changes: object) -> DecoderLayout:
    from dataclasses import replace

    return replace(layout, **changes)


def _probe_width_key(model: nn.Module, layout: DecoderLayout, width: int) -> str | None:
    config = model.config
    values = config.to_dict()
    keys = sorted(
        (k for k, v in values.items() if _WIDTH_KEY_HINT.search(k) and (v == width or v is None)),
        key=lambda k: (values[k] != width, k),
    )
    narrower = max(1, width // 2)
    for key in keys:
        probe = _build_on_meta(model, config, {key: narrower})
        if probe is None:
            continue
        layers = layout.decoder_layers(probe)
        if all(weight_out_in(layout.mlp_modules(layer)[1]).shape[1] == narrower for layer in layers):
            return key
    return None


def _probe_layers(model: nn.Module, layout: DecoderLayout) -> bool:
    count = model.config.num_hidden_layers
    if count < 2:
        return True
    probe = _build_on_meta(model, model.config, first_layers(model.config, count - 1))
    return probe is not None and len(layout.decoder_layers(probe)) == count - 1


def _probe_heads(model: nn.Module, layout: DecoderLayout) -> bool:
    config = model.config
    q, k, _, _ = layout.attention_modules_unchecked(layout.decoder_layers(model)[0])
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    head_dim = weight_out_in(q).shape[0] // heads
    if weight_out_in(k).shape[0] != kv * head_dim:
        return False
    per_group = heads // kv
    new_kv, new_per = (kv - 1, per_group) if kv > 1 else (1, max(1, per_group - 1))
    if (new_kv, new_per) == (kv, per_group):
        return True  # one head: nothing fewer to express, nothing to refuse
    changes = {"num_attention_heads": new_kv * new_per, "head_dim": head_dim}
    if layout.kv_heads_key:
        changes[layout.kv_heads_key] = new_kv
    probe = _build_on_meta(model, config, changes)
    if probe is None:
        return False
    pq, pk, _, po = layout.attention_modules_unchecked(layout.decoder_layers(probe)[0])
    return (
        weight_out_in(pq).shape[0] == new_kv * new_per * head_dim
        and weight_out_in(pk).shape[0] == new_kv * head_dim
        and weight_out_in(po).shape[1] == new_kv * new_per * head_dim
    )
