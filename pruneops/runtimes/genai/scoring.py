"""Scoring text with an exported decoder (ONNX Runtime alone: no torch, no web framework).

Used by serving's `/feedback` and by the benchmark, so a quantised model is judged by its own
logits where it serves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from pruneops.core.logits import token_nll


def decoder_window(decoder: dict) -> int:
    """The local attention window of a `genai_config.json` decoder block (0: none; Gemma 2 and 3 have one)."""
    return int((decoder.get("sliding_window") or {}).get("window_size", 0))


def prefill_logits(session: object, decoder: dict, ids: np.ndarray) -> np.ndarray:
    """Logits at every position of one sequence under an exported decoder (empty KV cache).

    Args:
        session: An ONNX Runtime session of the builder's `model.onnx`.
        decoder: The `model.decoder` block of its `genai_config.json`.
        ids: (length,) token ids.

    Returns:
        (length, vocab) logits: row i predicts token i + 1.
    """
    ids = np.asarray(ids, dtype=np.int64)[None, :]
    feed: dict[str, np.ndarray] = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    # Sliding-window attention (Gemma 2 and 3) wants a cache buffer at least a window long; it stays
    # empty (the mask covers the sequence only), so the logits are those of an empty cache.
    window = decoder_window(decoder)
    capacity = max(window, ids.shape[1]) if window else 0
    for spec in session.get_inputs():
        if spec.name == "position_ids":
            feed["position_ids"] = np.arange(ids.shape[1], dtype=np.int64)[None, :]
        elif spec.name.startswith("past_key_values"):
            dtype = np.float16 if "float16" in spec.type else np.float32
            shape = (1, decoder["num_key_value_heads"], capacity, decoder["head_size"])
            feed[spec.name] = np.zeros(shape, dtype=dtype)
    return session.run(["logits"], feed)[0][0]


def prefill_losses(session: object, decoder: dict, ids: np.ndarray) -> np.ndarray:
    """Next-token NLL at every position of one sequence, from `prefill_logits` (its arguments): (length - 1,).

    Position i is the NLL of token i + 1.
    """
    ids = np.asarray(ids, dtype=np.int64).reshape(-1)
    return token_nll(prefill_logits(session, decoder, ids)[:-1], ids[1:])


def open_scorer(folder: Path, threads: int = 1) -> tuple[object, dict]:
    """An ONNX Runtime session over a genai folder's decoder (the onnxruntime runtime's), and its config block."""
    from pruneops.runtimes.onnxruntime.files import make_session

    decoder = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    return make_session(folder / decoder["filename"], threads), decoder
