"""`train.preprocess`: resize, channel repeat and mean/std run inside the model, exported with it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pruneops.core.errors import ConfigError
from pruneops.models import ModelSpec, create_model
from pruneops.models.preprocess import ATTRIBUTE

IMAGENET = {"resize": [16, 16], "channels": 3, "mean": [0.485, 0.456, 0.406], "std": [0.229, 0.224, 0.225]}


def _spec(preprocess=IMAGENET, name="cnn", shape=(1, 8, 8)):
    return ModelSpec(name, list(shape), 10, {"widths": [8, 16]}, preprocess=preprocess)


def test_the_model_runs_the_declared_preprocessing_on_raw_inputs():
    torch.manual_seed(0)
    model = create_model(_spec()).eval()
    x = torch.rand(4, 1, 8, 8)
    mean, std = torch.tensor(IMAGENET["mean"]).view(1, 3, 1, 1), torch.tensor(IMAGENET["std"]).view(1, 3, 1, 1)
    by_hand = (F.interpolate(x, size=(16, 16), mode="bilinear", align_corners=False).repeat(1, 3, 1, 1) - mean) / std
    hook = model._forward_pre_hooks.popitem()[1]  # the network alone, fed what the preprocessing makes
    expected = model(by_hand)
    model.register_forward_pre_hook(hook)
    torch.testing.assert_close(model(x), expected)
    assert not any(k.startswith(ATTRIBUTE) for k in model.state_dict())  # rebuilt from the spec, not stored


def test_preprocessing_survives_checkpoints_copies_and_onnx_export(tmp_path):
    import copy

    from pruneops.models.checkpoint import load_checkpoint, save_checkpoint
    from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session, ort_logits

    torch.manual_seed(0)
    spec = _spec()
    model = create_model(spec).eval()
    x = torch.rand(5, 1, 8, 8)
    with torch.no_grad():
        ref = model(x)
        save_checkpoint(tmp_path / "m.safetensors", model, spec)
        torch.testing.assert_close(load_checkpoint(tmp_path / "m.safetensors").model(x), ref)
        torch.testing.assert_close(copy.deepcopy(model)(x), ref)
    export_onnx_file(model, spec.input_shape, tmp_path / "m.onnx", 18)
    import onnx

    ops = {n.op_type for n in onnx.load(str(tmp_path / "m.onnx")).graph.node}
    assert "Resize" in ops  # the deployed file starts with the preprocessing
    out = ort_logits(make_session(tmp_path / "m.onnx"), x.numpy())
    np.testing.assert_allclose(out, ref.numpy(), atol=1e-4)


def test_the_factory_is_built_for_the_preprocessed_shape_and_pruning_sees_raw_inputs():
    from pruneops.pruning.importance import IMPORTANCES
    from pruneops.pruning.units import UnitPruner

    model = create_model(_spec()).eval()
    first_conv = next(m for m in model.modules() if isinstance(m, torch.nn.Conv2d))
    assert first_conv.in_channels == 3  # built for the 3-channel 16x16 input the preprocessing makes
    example = torch.zeros(1, 1, 8, 8)
    pruner = UnitPruner(model, example, IMPORTANCES.get("l2"))
    units = pruner.units()
    assert units  # the preprocessing has no weights: only the network's channels are units
    assert not any(n.startswith(ATTRIBUTE) for n in units)


@pytest.mark.parametrize(
    ("preprocess", "shape", "message"),
    [
        ({"channels": 1}, (3, 8, 8), r"train.preprocess.channels: 1 from 3-channel images"),
        ({"channels": 3, "mean": [0.5, 0.5]}, (1, 8, 8), r"train.preprocess.mean: 2 values for 3 channels"),
        ({"resize": [4, 4]}, (64,), r"train.preprocess: needs images \(C, H, W\)"),
    ],
)
def test_preprocessing_that_does_not_fit_the_data_is_one_config_error(preprocess, shape, message):
    with pytest.raises(ConfigError, match=message):
        create_model(_spec(preprocess, name="mlp" if len(shape) == 1 else "cnn", shape=shape))


@pytest.mark.slow
def test_the_pipeline_prunes_and_deploys_a_model_with_preprocessing_on_raw_inputs(tmp_path):
    """Eight stages by params alone; every exported file takes the raw 1x8x8 digits."""
    import onnx

    from pruneops.core.io import Layout, read_json
    from pruneops.modelstore.store import pipeline_input_description
    from pruneops.pipeline.runner import run_stage
    from pruneops.pipeline.stages import STAGE_NAMES
    from tests.conftest import tiny_params, write_params

    params = tiny_params(train={"preprocess": IMAGENET})
    path = write_params(tmp_path, params)
    for stage in STAGE_NAMES:
        run_stage(stage, path, tmp_path)
    train = read_json(tmp_path / "metrics/train.json")
    assert train["test_accuracy"] > 0.8  # digits through resize + 3 channels + ImageNet mean/std still learn
    export = tmp_path / "artifacts/export"
    for name in ("dense_fp32", "pruned_fp32", "pruned_deployed"):
        graph = onnx.load(str(export / f"{name}.onnx")).graph
        dims = [d.dim_value for d in graph.input[0].type.tensor_type.shape.dim[1:]]
        assert dims == [1, 8, 8] and "Resize" in {n.op_type for n in graph.node}, name
    assert pipeline_input_description(Layout(tmp_path)) == {
        "input_shape": [1, 8, 8],
        "value_range": [0.0, 16.0],
        "class_names": None,
        "inputs": None,  # one float input, not named text inputs
        "text": None,
    }
