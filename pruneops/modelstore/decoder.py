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


MIN_SERVING_CONTEXT = 64  # tokens a served decoder must hold (prompt and answer): fewer serves no request
CHECK_TOKENS = 4  # tokens the check generates


def check_decoder_runs(path: Path) -> tuple[object, int]:
    """Opens a decoder version as the server would and generates from it; returns (the opened model, vocabulary).

    It loads in its serving runtime, its tokenizer loads, its chat template (if any) compiles, its
    context holds `MIN_SERVING_CONTEXT` tokens, it generates `CHECK_TOKENS` tokens from a prompt
    the tokenizer writes (greedy, through the same `start`/`step` the server runs), and its logits
    score finite.

    Raises:
        ValueError: What would keep the server from serving it (the runtime's error, a context too
            short, tokens out of the vocabulary, non-finite logits).
    """
    from tokenizers import Tokenizer

    from pruneops.runtimes.chat import load_chat_template

    folder = Path(path)
    try:
        model = runtime_of(folder, DECODER_TASK).open(folder).load()
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        load_chat_template(folder)
    except Exception as exc:  # noqa: BLE001 - a runtime, tokenizer or template that fails: not servable
        raise ValueError(f"does not load as the server loads it: {str(exc)[:300]}") from None
    context = int(model.context_length)
    if context < MIN_SERVING_CONTEXT:
        raise ValueError(f"its context holds {context} tokens; a served decoder needs at least {MIN_SERVING_CONTEXT}")
    prompt = tokenizer.encode("The", add_special_tokens=True).ids or [0]
    try:
        generation = model.start(prompt, len(prompt) + CHECK_TOKENS, None)
        tokens = [generation.step()]
        while not generation.done and len(tokens) < CHECK_TOKENS:
            tokens.append(generation.step())
        losses = model.token_losses(np.asarray(prompt + tokens, dtype=np.int64))
    except Exception as exc:  # noqa: BLE001 - the runtime's error while generating
        raise ValueError(f"does not generate: {str(exc)[:300]}") from None
    if any(not 0 <= t < model.vocab_size for t in tokens):
        raise ValueError(f"generated token ids outside its vocabulary of {model.vocab_size}")
    if len(losses) and not np.isfinite(losses).all():
        raise ValueError("non-finite logits")
    return model, model.vocab_size
