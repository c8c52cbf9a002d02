"""The synthetic latency model the planning tests share."""

from __future__ import annotations

import pytest

from pruneops.models import ModelSpec
from pruneops.runtimes.onnxruntime.layers import LatencyTable
from tests.planning.latency_cases import SHAPE, _latency_model, _staircase


@pytest.fixture
def synthetic(monkeypatch):
    """A latency model of a residual CNN over the synthetic staircase (no timing)."""
    monkeypatch.setattr(LatencyTable, "layer_ms", lambda self, shape, batch, form="fp32": _staircase(shape, batch))
    _, _, sizes, latency = _latency_model(ModelSpec("cnn", SHAPE, 10, {"widths": [64, 128]}))
    return latency, sizes
