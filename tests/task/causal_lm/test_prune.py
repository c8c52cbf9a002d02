"""The decoder prune stage's calibration: the corpus's blocks, and a share written by the dense model."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("transformers")

from pruneops.config import DecoderCutConfig  # noqa: E402
from pruneops.models.language import SELF_TEXT_PROMPT, calibration_blocks  # noqa: E402
from pruneops.task.causal_lm.prune import _calibration_blocks  # noqa: E402
from tests.decoder_helpers import random_blocks, tiny_decoder  # noqa: E402


def test_calibration_blocks_are_the_corpus_first_then_the_share_the_dense_model_writes():
    model = tiny_decoder("llama", 0).eval()
    train = random_blocks(10, 24).numpy()
    np.testing.assert_array_equal(calibration_blocks(model, train, 6, 0.0, seed=0), train[:6])
    mixed = calibration_blocks(model, train, 6, 0.5, seed=0)
    assert mixed.shape == (6, 24) and mixed.dtype == train.dtype
    np.testing.assert_array_equal(mixed[:3], train[:3])
    np.testing.assert_array_equal(mixed[3:, :SELF_TEXT_PROMPT], train[:3, :SELF_TEXT_PROMPT])  # written after them
    assert not np.array_equal(mixed[3:], train[:3])
    np.testing.assert_array_equal(calibration_blocks(model, train, 6, 0.5, seed=0), mixed)  # reproducible
    assert calibration_blocks(model, train, 40, 1.0, seed=0).shape == (10, 24)  # at most the training blocks
    cut = DecoderCutConfig(calibration_blocks=6, calibration_self_fraction=0.5)
    np.testing.assert_array_equal(_calibration_blocks(model, train, cut, seed=0), mixed)  # what prune calibrates on
