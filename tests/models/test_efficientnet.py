"""`efficientnet_lite0`: the package's module tree, so its ImageNet weights load strictly; it prunes
and exports like the other families. Needs the `vision` extra and `make vision-assets`."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from pruneops.models import ModelSpec, classifier_of, create_model
from pruneops.models.init_weights import load_init_weights_, read_state_dict
from pruneops.models.profiling import count_macs
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session
from tests.conftest import ROOT

pytest.importorskip(
    "efficientnet_lite_pytorch", reason="efficientnet-lite-pytorch (the `vision` extra) is not installed"
)
WEIGHTS = ROOT / "assets/efficientnet-lite0-57934424.pth"
needs_weights = pytest.mark.skipif(
    not WEIGHTS.is_file(), reason="EfficientNet-Lite0 weights absent (make vision-assets)"
)


@needs_weights
def test_imagenet_weights_load_strictly_with_the_same_logits_as_the_package():
    from efficientnet_lite_pytorch import EfficientNet

    ours = create_model(ModelSpec("efficientnet_lite0", [3, 64, 64], 1000)).eval()
    adopted = load_init_weights_(ours, WEIGHTS, strict=True, reset_classifier=False)
    assert not adopted.reset_classifier and not adopted.missing and not adopted.unexpected
    theirs = EfficientNet.from_name("efficientnet-lite0", num_classes=1000, image_size=64).eval()
    theirs.load_state_dict(torch.load(WEIGHTS, weights_only=True), strict=True)
    x = torch.rand(2, 3, 64, 64, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(ours(x), theirs(x))


@needs_weights
def test_a_new_head_for_ten_classes_and_every_other_tensor_bit_for_bit():
    model = create_model(ModelSpec("efficientnet_lite0", [3, 32, 32], 10))
    adopted = load_init_weights_(model, WEIGHTS, strict=True, reset_classifier=None)
    assert adopted.reset_classifier
    head = classifier_of(model)
    assert head is model._fc and head.out_features == 10
    state = read_state_dict(WEIGHTS)
    for name, tensor in model.state_dict().items():
        if not name.startswith("_fc."):
            assert torch.equal(tensor, state[name]), name


def test_prunes_and_exports_with_parity(tmp_path):
    torch.manual_seed(0)
    model = create_model(ModelSpec("efficientnet_lite0", [3, 32, 32], 10)).eval()
    example = torch.rand(1, 3, 32, 32)
    pruner = UnitPruner(model, example, IMPORTANCES.get("l2"))
    units = pruner.units()
    assert "_conv_head" in units and not any(n.startswith("_fc") for n in units)
    macs = count_macs(model, [3, 32, 32])
    pruner.prune_to_({n: max(1, u.size // 2) for n, u in units.items()})
    assert count_macs(model, [3, 32, 32]) < 0.5 * macs
    export_onnx_file(model, [3, 32, 32], tmp_path / "m.onnx", 18)
    x = np.random.default_rng(0).random((4, 3, 32, 32), dtype=np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    np.testing.assert_allclose(make_session(tmp_path / "m.onnx").run(None, {"input": x})[0], ref, atol=1e-4, rtol=1e-3)


def test_refuses_non_square_images():
    from pruneops.core.errors import ConfigError

    with pytest.raises(ConfigError, match="square images"):
        create_model(ModelSpec("efficientnet_lite0", [3, 32, 48], 10))
