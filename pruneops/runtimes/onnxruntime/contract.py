"""The serving contract of an ONNX classifier: what a client sends it and what it answers.

Two exports with the same contract serve the same requests: the same named inputs (dtype and
per-example shape), the same preprocessing (an image's value range, a text's tokenizer and
length) and the same classes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from pruneops.runtimes.onnxruntime.files import INPUT_NAME


def probe(session: Any, metadata: dict[str, Any]) -> tuple[tuple[int, ...], int, np.ndarray]:
    """Runs one example through a session: (per-example input shape, classes, the logits).

    A single input is an array of its declared shape; named text inputs are one example of the
    data's max_length (`metadata["input"]["input_shape"]`).
    """
    inputs = session.get_inputs()
    if len(inputs) == 1:
        input_shape = tuple(int(d) for d in inputs[0].shape[1:])
        feed = {INPUT_NAME: np.zeros((1, *input_shape), dtype=np.float32)}
    else:
        input_shape = tuple(metadata.get("input", {}).get("input_shape") or [8])
        feed = {i.name: np.ones((1, *input_shape), dtype=np.int64) for i in inputs}
    out = session.run(None, feed)[0]
    return input_shape, int(out.shape[1]) if out.ndim == 2 else -1, out


def serving_contract(
    inputs: list[tuple[str, str, list]], num_classes: int, metadata: dict[str, Any], tokenizer_sha256: str | None
) -> dict[str, Any]:
    """The contract of a model, JSON-ready.

    Args:
        inputs: Each ONNX input's name, element type and per-example shape (symbolic axes as names).
        num_classes: Logits per example.
        metadata: The version's metadata (its `input` block describes preprocessing and classes).
        tokenizer_sha256: The digest of a text model's tokenizer; None for arrays and images.
    """
    described = metadata.get("input") or {}
    text = described.get("text")
    return {
        "inputs": [
            [name, dtype, [d if isinstance(d, int) else "dynamic" for d in shape]] for name, dtype, shape in inputs
        ],
        "num_classes": int(num_classes),
        "class_names": described.get("class_names"),
        "value_range": described.get("value_range"),
        "text": {"max_length": text.get("max_length")} if isinstance(text, dict) else None,
        "tokenizer_sha256": tokenizer_sha256,
    }
