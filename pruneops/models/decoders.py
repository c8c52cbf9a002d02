"""Decoder LLMs: loading a causal LM (HuggingFace folder or GGUF), and slicing it in place.

Pruning changes the modules and the config together (where they are: `decoder_layout`), so the
result is a model `from_pretrained`, onnxruntime-genai's model builder and GGUF tools load as they
load the original (uniform shapes, expressed by the config). Requires the `hf` and `llm` extras.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple

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


PROBE_TOKENS = 8  # greedy tokens a family probe compares


class FamilyProbe(NamedTuple):
    """A small random copy of a model's family, the blocks its export is checked on, and torch's answers.

    Attributes:
        model: The copy: the family, the attention geometry and every per-layer setting of the
            model's first two layers, a vocabulary of 512 tokens (at least its special ids), random weights.
        blocks: (2, 24) token ids; the first 8 of the first block are the greedy prompt.
        greedy: torch's `PROBE_TOKENS` greedy tokens after that prompt, end of sequence never chosen.
        losses: torch's mean next-token loss of each block.
    """

    model: nn.Module
    blocks: torch.Tensor
    greedy: list[int]
    losses: torch.Tensor


def family_probe(model: nn.Module, full_vocabulary: bool = False) -> FamilyProbe:
    """A small random copy of `model`'s family with torch's greedy tokens and losses (`FamilyProbe`).

    What a runtime's `cannot_serve` exports and compares: a runtime that refuses the config, and one
    that builds it but computes something else, both show in seconds. `full_vocabulary` keeps the
    model's vocabulary (for a converter that writes the tokenizer beside the weights and checks one
    against the other); otherwise 512 tokens.
    """
    import copy

    from transformers import AutoModelForCausalLM

    from pruneops.models.decoder_layout import first_layers
    from pruneops.models.language import block_losses

    config = copy.deepcopy(model.config)
    for key, value in first_layers(config, min(config.num_hidden_layers, 2)).items():
        setattr(config, key, value)
    if not full_vocabulary:
        config.vocab_size = max(512, *(special_ids(config) or [0])) + 1
    torch.manual_seed(0)
    probe = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in probe.named_parameters():
            if "norm" not in name and param.dim() > 1:
                param.normal_(0.0, 0.2)
    blocks = torch.randint(3, 500, (2, 24), generator=torch.Generator().manual_seed(1))
    greedy = _greedy(probe, blocks[:1, :8], PROBE_TOKENS, special_ids(config, eos_only=True))
    return FamilyProbe(probe, blocks, greedy[0].tolist(), torch.as_tensor(block_losses(probe, blocks)))


def special_ids(config: object, eos_only: bool = False) -> list[int]:
    """The config's BOS, EOS and pad ids (EOS alone with `eos_only`), lists flattened."""
    keys = ("eos_token_id",) if eos_only else ("bos_token_id", "eos_token_id", "pad_token_id")
    ids: list[int] = []
    for key in keys:
        value = getattr(config, key, None)
        ids += [v for v in (value if isinstance(value, list) else [value]) if isinstance(v, int)]
    return ids


def _greedy(model: nn.Module, prompt: torch.Tensor, new: int, eos: list[int]) -> torch.Tensor:
    """Greedy tokens by full recomputation, end-of-sequence never chosen (as the runtimes' timing runs)."""
    ids = prompt
    with torch.inference_mode():
        for _ in range(new):
            logits = model(input_ids=ids, use_cache=False).logits[:, -1].clone()
            logits[:, eos] = -torch.inf
            ids = torch.cat([ids, logits.argmax(-1, keepdim=True)], 1)
    return ids[:, prompt.shape[1] :]
