"""HuggingFace sequence classifiers: the `hf` model, offline pretrained weights, pruned save/reload.

`train.model: hf` builds `AutoModelForSequenceClassification` from a config kept in the
checkpoint (so a checkpoint rebuilds without the pretrained folder) and `train.pretrained` loads
the folder's weights offline (`local_files_only`).

transformers 5.x has no prune_heads: for `save_pruned_hf`, the pruned shapes (per-layer head
counts, FFN widths) are written into the model's config as `pruneops_structure`; loading
builds the full-size architecture from the config, shrinks every module to those shapes and
loads the weights strictly. Requires the `hf` extra.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from pruneops.core.errors import CheckpointError, ConfigError
from pruneops.core.inputs import InputSpec, text_inputs
from pruneops.models.registry import MODELS
from pruneops.models.structure import module_structure, resize_to_structure_

STRUCTURE_KEY = "pruneops_structure"


class SequenceLogits(nn.Module):
    """A HuggingFace sequence classifier as tensors in, logits out (what tracing and export take).

    The inputs are positional in `input_specs` order, so an ONNX export gets named int64 inputs.
    After `pruneops.pruning.vocabulary.trim_vocabulary_`, `token_map` sends the tokenizer's ids to
    the rows of the trimmed embedding (ids it dropped to the unknown token's row), so the tokenizer
    and what serving feeds stay as they were.
    """

    token_map: torch.Tensor | None

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model
        # A buffer even while None: a trimmed checkpoint's map then loads into it by name.
        self.register_buffer("token_map", None)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        token_type_ids: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.token_map is not None:
            input_ids = self.token_map[input_ids]
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


# Keys of a saved config that describe where it came from, not the architecture.
_CONFIG_NOISE = ("_name_or_path", "transformers_version", "architectures", "_commit_hash")


def pretrained_config(folder: str | Path, overrides: dict | None = None) -> dict:
    """The architecture config of a local pretrained folder as a JSON-ready dict (offline).

    Raises:
        ConfigError: No readable `config.json` there, or transformers is not installed.
    """
    try:
        from transformers import AutoConfig
    except ImportError:
        raise ConfigError("train.model: 'hf' needs transformers (pip install -e '.[hf]')") from None
    try:
        config = AutoConfig.from_pretrained(str(folder), local_files_only=True)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"train.pretrained: {folder} is not a pretrained model folder ({exc})") from None
    data = {k: v for k, v in config.to_dict().items() if k not in _CONFIG_NOISE}
    return {**data, **(overrides or {})}


@MODELS.register("hf", "a HuggingFace sequence classifier (train.pretrained: a local folder; offline)")
def hf_classifier(num_classes: int, hf_config: dict) -> nn.Module:
    """`AutoModelForSequenceClassification` of `hf_config` with `num_classes` outputs, fresh weights.

    Args:
        num_classes: Number of labels.
        hf_config: The architecture (`pretrained_config`), `model_type` included.
    """
    from transformers import AutoConfig, AutoModelForSequenceClassification

    data = dict(hf_config)
    data.pop("num_labels", None)
    data.pop("id2label", None)
    data.pop("label2id", None)
    config = AutoConfig.for_model(data.pop("model_type"), **data)
    config.num_labels = num_classes
    return SequenceLogits(AutoModelForSequenceClassification.from_config(config))


def load_pretrained_(model: nn.Module, folder: str | Path) -> list[str]:
    """Loads a pretrained folder's weights into an `hf` model (offline); a missing head starts fresh.

    Returns:
        What was not taken from the folder (a new classifier head), as report warnings.

    Raises:
        ConfigError: The folder's weights do not fit the architecture.
    """
    from transformers import AutoModelForSequenceClassification
    from transformers.utils import logging as hf_logging

    inner = model.model if isinstance(model, SequenceLogits) else model
    hf_logging.set_verbosity_error()  # its load report repeats what the returned warning says
    hf_logging.disable_progress_bar()
    try:
        loaded, info = AutoModelForSequenceClassification.from_pretrained(
            str(folder),
            config=inner.config,
            local_files_only=True,
            output_loading_info=True,
            ignore_mismatched_sizes=True,
        )
    except (OSError, ValueError, RuntimeError) as exc:
        raise ConfigError(f"train.pretrained: cannot load weights from {folder} ({exc})") from None
    inner.load_state_dict(loaded.state_dict())
    fresh = sorted({*info.get("missing_keys", []), *(k for k, *_ in info.get("mismatched_keys", []))})
    if not fresh:
        return []
    return [f"train.pretrained: {len(fresh)} tensors not in {folder} start fresh (a new head): {', '.join(fresh[:4])}"]


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
