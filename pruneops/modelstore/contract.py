"""The serving contract of a model version: what a client sends it and what it answers.

Two versions with the same contract serve the same requests: the same named inputs (dtype and
per-example shape), the same preprocessing (an image's value range, a text's tokenizer and
length) and the same classes. Promotion and rollback compare the candidate's contract with
production's, so that a running server never swaps in a model every request would fail on, and
a restarted one never starts serving it by surprise.
"""

from __future__ import annotations

from typing import Any

CONTRACT_KEYS = ("inputs", "num_classes", "class_names", "value_range", "text", "tokenizer_sha256")


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


def contract_differences(candidate: dict[str, Any], served: dict[str, Any]) -> list[str]:
    """What differs between two contracts, one short phrase per key (empty when they match)."""
    differences = []
    for key in CONTRACT_KEYS:
        new, old = candidate.get(key), served.get(key)
        if new != old:
            differences.append(f"{key} {_short(new)} instead of {_short(old)}")
    return differences


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 1] + "…"
