"""Decoder LLMs: loading a causal LM (HuggingFace folder or GGUF) and the layouts pruning reads.

A `DecoderLayout` names where a family keeps its decoder layers, each layer's MLP projections
and attention projections, and which config keys hold the widths, so that pruning changes the
modules and the config together: the result is a model `from_pretrained`, onnxruntime-genai's
model builder and GGUF tools load as they load the original (uniform shapes, expressed by the
config). Layouts are registered by `model_type`; an unknown one is refused with what it lacks.
Requires the `hf` and `llm` extras.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from pruneops.core.errors import CheckpointError, ConfigError


@dataclass(frozen=True)
class DecoderLayout:
    """Where one family keeps what decoder pruning cuts.

    Args:
        name: The layout's name (what refusals and reports call it).
        layers: Attribute path from the `*ForCausalLM` model to the `ModuleList` of decoder layers.
        mlp_inputs: Per layer, the projections that produce the MLP's hidden neurons (gate and up).
        mlp_output: Per layer, the projection that consumes them (down).
        mlp_width_key: Config key of the MLP width (None: derived from the hidden size, not settable).
        layers_key: Config key of the layer count.
        attention: Per layer, `(q, k, v, o)` projection paths; None where the family fuses them.
        attention_input: Per layer, the module whose input is the attention block's input (for
            block influence); the layer itself when None.
        heads_key: Config key of the query head count.
        kv_heads_key: Config key of the key/value head count (None: as many as query heads).
        head_dim_key: Config key of the head size (None: hidden size / heads, so heads cannot be cut).
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

    def decoder_layers(self, model: nn.Module) -> nn.ModuleList:
        """The model's decoder layers."""
        return _get(model, self.layers)

    def mlp_modules(self, layer: nn.Module) -> tuple[list[nn.Module], nn.Module]:
        """A layer's neuron-producing projections and the projection that consumes the neurons."""
        return [_get(layer, p) for p in self.mlp_inputs], _get(layer, self.mlp_output)

    def attention_modules(self, layer: nn.Module) -> tuple[nn.Module, nn.Module, nn.Module, nn.Module]:
        """A layer's q, k, v and o projections.

        Raises:
            ConfigError: The family fuses them or derives its head size (heads cannot be cut).
        """
        if self.attention is None or self.head_dim_key is None:
            raise ConfigError(
                f"prune: attention heads of the {self.name} layout cannot be cut: it fuses q/k/v or derives "
                "the head size from the hidden size, so no config expresses fewer heads (cut MLP neurons or layers)"
            )
        q, k, v, o = (_get(layer, p) for p in self.attention)
        return q, k, v, o


LLAMA = DecoderLayout(
    name="llama",
    layers="model.layers",
    mlp_inputs=("mlp.gate_proj", "mlp.up_proj"),
    mlp_output="mlp.down_proj",
    mlp_width_key="intermediate_size",
    layers_key="num_hidden_layers",
    attention=("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"),
)
GPT_NEOX = DecoderLayout(
    name="gpt_neox",
    layers="gpt_neox.layers",
    mlp_inputs=("mlp.dense_h_to_4h",),
    mlp_output="mlp.dense_4h_to_h",
    mlp_width_key="intermediate_size",
    layers_key="num_hidden_layers",
    kv_heads_key=None,
    head_dim_key=None,
)
GPT2 = DecoderLayout(
    name="gpt2",
    layers="transformer.h",
    mlp_inputs=("mlp.c_fc",),
    mlp_output="mlp.c_proj",
    mlp_width_key="n_inner",
    layers_key="n_layer",
    heads_key="n_head",
    kv_heads_key=None,
    head_dim_key=None,
)

# model_type (config.json) -> layout. Llama, Qwen2, Mistral and Gemma share the gate/up/down MLP
# and separate q/k/v/o projections with an explicit head size.
DECODER_LAYOUTS: dict[str, DecoderLayout] = {
    "llama": LLAMA,
    "qwen2": LLAMA,
    "qwen3": LLAMA,
    "mistral": LLAMA,
    "gemma": LLAMA,
    "gemma2": LLAMA,
    "gpt_neox": GPT_NEOX,
    "gpt2": GPT2,
}


def layout_of(model: nn.Module) -> DecoderLayout:
    """The layout of a causal LM, from its config's `model_type`.

    Raises:
        ConfigError: The family is not registered; names what a layout must provide.
    """
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    layout = DECODER_LAYOUTS.get(model_type)
    if layout is None:
        raise ConfigError(
            f"train.pretrained: decoder family {model_type!r} has no layout "
            f"(known: {', '.join(sorted(DECODER_LAYOUTS))}); "
            "a layout names the decoder layers, the MLP's producing and consuming projections and the config keys "
            "of their widths (pruneops.models.decoders.DECODER_LAYOUTS)"
        )
    layout.decoder_layers(model)  # a renamed module is refused here, not mid-prune
    return layout


def _get(root: nn.Module, path: str) -> nn.Module:
    module = root
    for part in path.split("."):
        if not hasattr(module, part):
            raise ConfigError(f"decoder layout: {type(root).__name__} has no {path!r}")
        module = getattr(module, part)
    return module


def load_causal_lm(path: str | Path) -> tuple[nn.Module, object]:
    """A causal LM and its tokenizer, offline, in fp32 and eval mode.

    Args:
        path: A HuggingFace folder (config.json, safetensors, tokenizer) or a `.gguf` file,
            dequantised by transformers' GGUF loader, its tokenizer read from the file.

    Raises:
        CheckpointError: Nothing loadable there.
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"train.pretrained: {path} does not exist")
    kwargs: dict = {"local_files_only": True}
    source = path
    if path.suffix == ".gguf":
        kwargs["gguf_file"] = path.name
        source = path.parent
    try:
        tokenizer = AutoTokenizer.from_pretrained(source, **kwargs)
        model = AutoModelForCausalLM.from_pretrained(source, dtype=torch.float32, **kwargs)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"train.pretrained: {path} is not a causal LM transformers loads: {exc}") from exc
    if path.suffix == ".gguf":
        # The weights are dequantised fp32 now: a config still naming the GGUF quantisation makes
        # save_pretrained refuse the model and builders look for quantised tensors.
        if hasattr(model.config, "quantization_config"):
            del model.config.quantization_config
        model.hf_quantizer = None
        model.is_quantized = False
    return model.eval(), tokenizer


def load_causal_tokenizer(path: str | Path) -> object:
    """The tokenizer of a causal LM's HuggingFace folder or `.gguf` file, offline.

    Raises:
        CheckpointError: No tokenizer there.
    """
    from transformers import AutoTokenizer

    path = Path(path)
    if not path.exists():
        raise CheckpointError(f"validate.tokenizer: {path} does not exist")
    try:
        if path.suffix == ".gguf":
            return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name, local_files_only=True)
        return AutoTokenizer.from_pretrained(path, local_files_only=True)
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"validate.tokenizer: {path} holds no tokenizer transformers loads: {exc}") from exc


def save_causal_lm(model: nn.Module, tokenizer: object, folder: str | Path) -> Path:
    """Writes a plain HuggingFace folder (safetensors, config, tokenizer) every runtime loads."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def keep_outputs_(module: nn.Module, index: torch.Tensor) -> None:
    """Keeps the output features `index` of a Linear (or GPT-2 Conv1D) in place."""
    _slice_(module, index, output=True)


def keep_inputs_(module: nn.Module, index: torch.Tensor) -> None:
    """Keeps the input features `index` of a Linear (or GPT-2 Conv1D) in place (bias untouched)."""
    _slice_(module, index, output=False)


def _slice_(module: nn.Module, index: torch.Tensor, output: bool) -> None:
    conv1d = type(module).__name__ == "Conv1D"  # GPT-2: weight is (in, out)
    dim = (1 if conv1d else 0) if output else (0 if conv1d else 1)
    module.weight = nn.Parameter(module.weight.data.index_select(dim, index).contiguous())
    if output and getattr(module, "bias", None) is not None:
        module.bias = nn.Parameter(module.bias.data[index].contiguous())
    if conv1d:
        module.nf = module.weight.shape[1]
    elif output:
        module.out_features = module.weight.shape[0]
    else:
        module.in_features = module.weight.shape[1]


def weight_out_in(module: nn.Module) -> torch.Tensor:
    """A projection's weight as (out, in), whatever its module stores."""
    return module.weight.data.t() if type(module).__name__ == "Conv1D" else module.weight.data


def set_weight_out_in_(module: nn.Module, weight: torch.Tensor) -> None:
    """Writes an (out, in) weight into a projection of the same shape."""
    target = weight.t() if type(module).__name__ == "Conv1D" else weight
    module.weight.data.copy_(target)


def remove_layers_(model: nn.Module, drop: list[int]) -> None:
    """Removes whole decoder layers and updates the config (and per-layer config lists) to match."""
    layout = layout_of(model)
    layers = layout.decoder_layers(model)
    keep = [i for i in range(len(layers)) if i not in set(drop)]
    if not keep:
        raise ConfigError("prune: removing every decoder layer leaves no model")
    kept = nn.ModuleList([layers[i] for i in keep])
    parent_path, _, attr = layout.layers.rpartition(".")
    setattr(_get(model, parent_path) if parent_path else model, attr, kept)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):  # the KV cache is indexed by it
                module.layer_idx = new_index
    config = model.config
    setattr(config, layout.layers_key, len(kept))
    for key in ("layer_types",):  # per-layer lists (sliding/full attention) follow the kept layers
        values = getattr(config, key, None)
        if isinstance(values, list) and len(values) == len(layers):
            setattr(config, key, [values[i] for i in keep])


def mlp_width(model: nn.Module) -> int:
    """The MLP width every layer shares (uniform shapes are what a config expresses)."""
    layout = layout_of(model)
    widths = {weight_out_in(layout.mlp_modules(layer)[1]).shape[1] for layer in layout.decoder_layers(model)}
    if len(widths) != 1:
        raise ConfigError(f"prune: MLP widths differ between layers ({sorted(widths)}); a config expresses one width")
    return widths.pop()


def set_config_width(model: nn.Module, key: str | None, value: int, what: str) -> None:
    """Records a uniform width in the config, refusing a family whose config cannot express it."""
    if key is None:
        raise ConfigError(f"prune: the {layout_of(model).name} layout has no config key for the {what}")
    setattr(model.config, key, value)


LayerHook = Callable[[int, nn.Module], None]
