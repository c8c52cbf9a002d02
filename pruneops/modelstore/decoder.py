"""Decoder LLM versions in the registry: an onnxruntime-genai folder, checked to serve, and its contract.

A decoder version's directory is the genai folder the export stage wrote (`model.onnx` and its
external data, `genai_config.json`, the tokenizer) plus `metadata.json` (`task: causal_lm`) and the
prompt-drift reference as `reference_stats.json`. Its contract is the vocabulary size and the
tokenizer's digest: a candidate that tokenises otherwise is a contract change.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from pruneops.core.io import Layout, read_json
from pruneops.runtimes import runtime_of

DECODER_TASK = "causal_lm"
SERVED_FILE = "served.json"  # written by the export stage of a causal LM: the served precision
GENAI_CONFIG = "genai_config.json"


def is_decoder_export(layout: Layout) -> bool:
    """Whether the pipeline's export stage wrote a decoder (a genai folder) rather than a classifier."""
    return (layout.stage_dir("export") / SERVED_FILE).is_file()


def is_decoder_version(metadata: dict[str, Any]) -> bool:
    """Whether a registered version is a decoder LLM."""
    return metadata.get("task") == DECODER_TASK


def decoder_export(layout: Layout) -> tuple[Path, Path, dict[str, Any]]:
    """The served genai folder, its prompt reference and the metadata a decoder version adds."""
    export = layout.stage_dir("export")
    served = read_json(export / SERVED_FILE)
    metadata = {"task": DECODER_TASK, "precision": served["precision"], "vocabulary": served["vocabulary"]}
    return export / "model", export / "prompt_reference.json", metadata


def decoder_contract(path: Path) -> dict[str, Any]:
    """What requests a decoder version serves: its vocabulary and tokenizer (its runtime's contract)."""
    return runtime_of(Path(path), DECODER_TASK).contract(Path(path), {})


def check_decoder_runs(path: Path) -> tuple[object, int]:
    """Opens a decoder version in its runtime and scores a few tokens; returns (the opened model, vocabulary).

    Raises:
        ValueError: Non-finite or missing logits.
    """
    model = runtime_of(Path(path), DECODER_TASK).open(Path(path))
    losses = model.token_losses(np.arange(4, dtype=np.int64) % model.vocab_size)
    if not np.isfinite(losses).all():
        raise ValueError("non-finite logits")
    return model, model.vocab_size
