"""Text requests in the torch-free serving image: tokenised by the model's own `tokenizer.json`.

The same `tokenizers` library and file that `validate` used, truncated and padded to the same
`max_length`, so a served text becomes exactly the ids the model was trained and evaluated on.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from pruneops.core.inputs import encode_texts, unknown_id
from pruneops.data.drift import text_drift_features

MAX_TEXT_CHARS = 100_000  # a longer "text" is a client error, not a review


class TextInputError(ValueError):
    """A text request that cannot be served (named: which text and why)."""


class TextEncoder:
    """Tokenises texts into the model's named int64 inputs.

    Args:
        tokenizer_file: The `tokenizer.json` registered with the model.
        max_length: Tokens per text, as `validate` tokenised the training data.
        input_names: The ONNX model's input names (ids, mask and optionally segment ids).
    """

    def __init__(self, tokenizer_file: Path, max_length: int, input_names: list[str]):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(tokenizer_file))
        self.max_length = max_length
        self.input_names = list(input_names)
        self.unknown_id = unknown_id(self.tokenizer)

    def encode(self, texts: list[str]) -> dict[str, np.ndarray]:
        """The model's feed for `texts`.

        Raises:
            TextInputError: A text that is empty or absurdly long.
        """
        for i, text in enumerate(texts):
            if not isinstance(text, str) or not text.strip():
                raise TextInputError(f"texts[{i}] is empty")
            if len(text) > MAX_TEXT_CHARS:
                raise TextInputError(f"texts[{i}] has {len(text)} characters (at most {MAX_TEXT_CHARS})")
        return encode_texts(self.tokenizer, texts, self.max_length, self.input_names)

    def drift_features(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        """What drift is measured on: each text's length share and unknown-token rate."""
        return text_drift_features(feed["input_ids"], feed["attention_mask"], self.max_length, self.unknown_id)
