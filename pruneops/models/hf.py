"""HuggingFace models after head/FFN pruning: save and reload (transformers 5.x has no prune_heads).

The pruned shapes (per-layer head counts, FFN widths) are written into the model's config as
`pruneops_structure`; loading builds the full-size architecture from the config, shrinks every
module to those shapes and loads the weights strictly. Requires the `hf` extra.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pruneops.checkpoint import module_structure, resize_to_structure_
from pruneops.errors import CheckpointError
from pruneops.inputs import InputSpec, text_inputs

STRUCTURE_KEY = "pruneops_structure"


class SequenceLogits(nn.Module):
    """A HuggingFace sequence classifier as tensors in, logits out (what tracing and export take).

    The inputs are positional in `input_specs` order, so an ONNX export gets named int64 inputs.
    """

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        kwargs = {"attention_mask": attention_mask}
        if token_type_ids is not None:
            kwargs["token_type_ids"] = token_type_ids
        return self.model(input_ids=input_ids, **kwargs).logits


def uses_token_types(model: nn.Module) -> bool:
    """Whether the model takes segment ids (its forward accepts them and it has more than one type)."""
    accepts = "token_type_ids" in inspect.signature(model.forward).parameters
    return accepts and int(getattr(model.config, "type_vocab_size", 0) or 0) > 1


def input_specs(model: nn.Module) -> tuple[InputSpec, ...]:
    """The named inputs of a HuggingFace text classifier: ids, mask and, if it uses them, segment ids."""
    return text_inputs(token_type_ids=uses_token_types(model))


def save_pruned_hf(model: nn.Module, directory: Path) -> None:
    """`save_pretrained` with the pruned shapes recorded in the config."""
    setattr(model.config, STRUCTURE_KEY, module_structure(model))
    model.save_pretrained(str(directory))


def load_pruned_hf(directory: Path, model_class: type) -> nn.Module:
    """Reloads a model saved by `save_pruned_hf` (eval mode).

    Args:
        directory: What `save_pruned_hf` wrote.
        model_class: The transformers class, e.g. `BertForSequenceClassification`.

    Raises:
        CheckpointError: Weights missing, corrupt or not fitting the recorded shapes.
    """
    directory = Path(directory)
    config = model_class.config_class.from_pretrained(str(directory))
    structure = getattr(config, STRUCTURE_KEY, None) or {}
    weights = directory / "model.safetensors"
    try:
        state = load_file(str(weights))
    except (OSError, ValueError) as exc:
        raise CheckpointError(f"{weights}: cannot read weights ({exc})") from None
    model = model_class(config)
    try:
        resize_to_structure_(model, structure, state)
        # Tied or buffer entries that save_pretrained leaves out stay as initialised.
        missing, unexpected = model.load_state_dict(state, strict=False)
    except (RuntimeError, ValueError) as exc:
        raise CheckpointError(f"{weights}: does not fit the recorded structure ({exc})") from None
    real_missing = [k for k in missing if not k.endswith("position_ids")]
    if real_missing or unexpected:
        raise CheckpointError(f"{weights}: missing {real_missing[:3]}, unexpected {unexpected[:3]}")
    return model.eval()
