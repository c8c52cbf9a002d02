import numpy as np
import pytest
import torch

from pruneops.data import Split
from pruneops.models import ModelSpec, create_model
from pruneops.models.profiling import count_macs, count_params
from pruneops.pruning.heads import head_sites
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import METHODS, PruneContext
from pruneops.pruning.report import layer_shapes, sparsity_report
from pruneops.pruning.units import UnitPruner, round_keep
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session, ort_logits
from pruneops.training.fit import FitSettings, fit_

SHAPE = [1, 8, 8]


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return Split(rng.random((n, *SHAPE), dtype=np.float32), (np.arange(n) % 10).astype(np.int64))


def test_cnn_units_cover_residual_groups_and_skip_classifier():
    model = create_model(ModelSpec("cnn", SHAPE, 10))
    units = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("l2")).units()
    assert {u.kind for u in units.values()} == {"channels"}
    assert "classifier" not in units
    # Stem + block-1 output share the residual stream: one coupled group, not two.
    assert sum(u.size for u in units.values()) == 64 + 64 + 128 + 128


def test_removing_zeroed_channels_keeps_outputs_identical():
    torch.manual_seed(0)
    model = create_model(ModelSpec("cnn", SHAPE, 10)).eval()
    with torch.no_grad():
        for bn in (model.stages[0].bn1, model.stages[1].bn1):
            bn.weight[::2] = 0.0
            bn.bias[::2] = 0.0
    x = torch.randn(4, *SHAPE)
    before = model(x)
    macs, params = count_macs(model, SHAPE), count_params(model)
    pruner = UnitPruner(model, x[:1], IMPORTANCES.get("bn_scale"))
    pruner.prune_to_({"stages.0.conv1": 32, "stages.1.conv1": 64})
    assert model.stages[0].conv1.out_channels == 32 and model.stages[1].conv2.in_channels == 64
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-4)
    assert count_macs(model, SHAPE) < macs and count_params(model) < params


def test_removing_masked_heads_keeps_outputs_identical():
    torch.manual_seed(0)
    model = create_model(ModelSpec("transformer", SHAPE, 10, {"dropout": 0.0})).eval()
    attn = model.layers[0].attn
    with torch.no_grad():
        rows = slice(1 * attn.head_dim, 2 * attn.head_dim)
        attn.out.weight[:, rows] = 0.0
    x = torch.randn(3, *SHAPE)
    before = model(x)
    UnitPruner(model, x[:1], IMPORTANCES.get("l2")).prune_to_({"layers.0.attn.heads": 3})
    assert attn.num_heads == 3 and attn.q.out_features == 3 * attn.head_dim
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-4)
    assert set(head_sites(model)) == {"layers.0.attn", "layers.1.attn"}


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_structurally_pruned_models_export_to_onnx_with_parity(tmp_path, name):
    torch.manual_seed(0)
    model = create_model(ModelSpec(name, SHAPE, 10)).eval()
    pruner = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("l1"))
    pruner.prune_to_({n: round_keep(u.size, 0.6, None) for n, u in pruner.units().items()})
    export_onnx_file(model, SHAPE, tmp_path / "m.onnx", 18)
    x = np.random.default_rng(0).random((7, *SHAPE), dtype=np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    assert np.abs(ort_logits(make_session(tmp_path / "m.onnx"), x) - ref).max() < 1e-4


def _ctx(model, target, **kw):
    return PruneContext(
        target_ratio=target,
        criterion=IMPORTANCES.get(kw.pop("importance", "l2")),
        example_input=torch.zeros(1, *SHAPE),
        train=_data(),
        **kw,
    )


@pytest.mark.parametrize("importance", ["l1", "l2", "taylor", "bn_scale", "random"])
def test_channel_method_reaches_target_with_every_importance(importance):
    model = create_model(ModelSpec("cnn", SHAPE, 10))
    method = METHODS.get("channel")(_ctx(model, 0.5, importance=importance, round_to=4))
    method.apply_(model, 1.0)
    sizes = [model.stages[0].conv1.out_channels, model.stages[1].conv1.out_channels, model.stem[0].out_channels]
    assert sizes == [32, 64, 32]
    for batch in (1, 3, 16):
        assert model(torch.zeros(batch, *SHAPE)).shape == (batch, 10)


def test_magnitude_method_reaches_target_and_masks_survive_training():
    model = create_model(ModelSpec("mlp", SHAPE, 10))
    method = METHODS.get("magnitude")(_ctx(model, 0.8))
    method.apply_(model, 0.5)
    report = sparsity_report(model, SHAPE, layer_shapes(model))
    prunable = sum(m.numel() for m in method.masks().values())
    zeros = sum(int((~m).sum()) for m in method.masks().values())
    assert zeros / prunable == pytest.approx(0.4, abs=1e-3)
    method.apply_(model, 1.0)
    fit_(model, _data(), _data(seed=1), FitSettings(epochs=2, patience=5), after_step=method.after_step)
    weights = dict(model.named_parameters())
    for name, mask in method.masks().items():
        assert torch.all(weights[name][~mask] == 0)
    zero = sum(int((weights[n] == 0).sum()) for n in method.masks())
    assert zero / prunable == pytest.approx(0.8, abs=0.005)
    report = sparsity_report(model, SHAPE, layer_shapes(model))
    assert report["global"]["nonzero_macs"] < 0.3 * report["global"]["macs"]
    assert report["layers"]["classifier"]["zero_fraction"] == 0.0


class ConcatNet(torch.nn.Module):
    """Two conv branches concatenated on channels, fused by a conv, flattened into a Linear.

    With `fuse=False` the concatenation is flattened straight into the Linear.
    """

    def __init__(self, fuse: bool = True):
        super().__init__()
        self.fuse = fuse
        self.a = torch.nn.Sequential(torch.nn.Conv2d(1, 8, 3, padding=1), torch.nn.BatchNorm2d(8), torch.nn.ReLU())
        self.b = torch.nn.Sequential(torch.nn.Conv2d(1, 12, 3, padding=1), torch.nn.BatchNorm2d(12), torch.nn.ReLU())
        self.mix = torch.nn.Conv2d(20, 16, 1)
        self.fc = torch.nn.Linear((16 if fuse else 20) * 4 * 4, 32)
        self.classifier = torch.nn.Linear(32, 10)

    def forward(self, x):
        x = torch.cat([self.a(x), self.b(x)], dim=1)
        if self.fuse:
            x = torch.relu(self.mix(x))
        x = torch.nn.functional.max_pool2d(x, 2)
        return self.classifier(torch.relu(self.fc(torch.flatten(x, 1))))


def _zero_channels_(conv, bn, channels):
    with torch.no_grad():
        bn.weight[channels] = 0.0
        bn.bias[channels] = 0.0


def test_channel_pruning_follows_concatenation_and_flatten(tmp_path):
    torch.manual_seed(0)
    model = ConcatNet().eval()
    macs = count_macs(model, SHAPE)
    pruner = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("bn_scale"))
    assert {"a.0", "b.0", "mix", "fc"} <= set(pruner.units()) and "classifier" not in pruner.units()
    pruner.prune_to_({"a.0": 4, "b.0": 6, "mix": 8})
    assert (model.a[0].out_channels, model.b[0].out_channels, model.mix.in_channels) == (4, 6, 10)
    # Each removed channel of `mix` takes its 4x4 block of flattened features out of fc's inputs.
    assert model.fc.in_features == 8 * 16 and model.classifier.out_features == 10
    assert count_macs(model, SHAPE) < macs / 1.5
    export_onnx_file(model, SHAPE, tmp_path / "m.onnx", 18)
    xs = np.random.default_rng(1).random((5, *SHAPE), dtype=np.float32)
    with torch.no_grad():
        ref = model(torch.from_numpy(xs)).numpy()
    assert np.abs(ort_logits(make_session(tmp_path / "m.onnx"), xs) - ref).max() < 1e-4


def test_zeroed_concat_branches_removed_with_identical_outputs():
    torch.manual_seed(0)
    model = ConcatNet().eval()
    _zero_channels_(model.a[0], model.a[1], [1, 3, 5, 7])
    _zero_channels_(model.b[0], model.b[1], [0, 2, 4, 6, 8, 10])
    x = torch.randn(4, *SHAPE)
    before = model(x)
    UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("bn_scale")).prune_to_({"a.0": 4, "b.0": 6})
    torch.testing.assert_close(model(x), before, atol=1e-5, rtol=1e-4)


def test_unmapped_concatenation_is_left_alone():
    model = ConcatNet(fuse=False).eval()
    units = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("l2")).units()
    assert "a.0" not in units and "b.0" not in units
    assert "fc" in units


def test_both_exporters_give_the_same_outputs(tmp_path):
    from pruneops.runtimes.onnxruntime.files import EXPORTERS

    torch.manual_seed(0)
    model = create_model(ModelSpec("transformer", SHAPE, 10)).eval()
    x = torch.randn(5, *SHAPE)
    with torch.no_grad():
        reference = model(x).numpy()
    for name in EXPORTERS.names():
        export_onnx_file(model, SHAPE, tmp_path / f"{name}.onnx", 18, name)
        got = ort_logits(make_session(tmp_path / f"{name}.onnx"), x.numpy())
        assert np.abs(got - reference).max() < 1e-4, name
