"""Decoder LLMs: loading a causal LM (HuggingFace folder or GGUF), and slicing it in place.

Pruning changes the modules and the config together (where they are: `decoder_layout`), so the
result is a model `from_pretrained`, onnxruntime-genai's model builder and GGUF tools load as they
load the original (uniform shapes, expressed by the config). Requires the `hf` and `llm` extras.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from pruneops.core.errors import CheckpointError, ConfigError
from pruneops.models.decoder_layout import PER_LAYER_KEYS, get_module, layout_of, weight_out_in


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
    setattr(get_module(model, parent_path) if parent_path else model, attr, kept)
    for new_index, layer in enumerate(kept):
        for module in layer.modules():
            if hasattr(module, "layer_idx"):  # the KV cache is indexed by it
                module.layer_idx = new_index
    config = model.config
    setattr(config, layout.layers_key, len(kept))
    for key in PER_LAYER_KEYS:  # per-layer lists (sliding/full attention) follow the kept layers
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
