"""Serving contracts compared: promotion and rollback refuse a version whose contract differs from production's.

Two versions with the same contract serve the same requests: the same named inputs (dtype and
per-example shape), the same preprocessing (an image's value range, a text's tokenizer and
length) and the same classes. Promotion and rollback compare the candidate's contract with
production's, so that a running server never swaps in a model every request would fail on, and
a restarted one never starts serving it by surprise.
"""

from __future__ import annotations

from typing import Any

CONTRACT_KEYS = ("inputs", "num_classes", "class_names", "value_range", "text", "tokenizer_sha256")


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
