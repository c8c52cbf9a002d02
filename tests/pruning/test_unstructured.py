"""Unstructured methods: magnitude (global/layer), movement, 2:4; masks apart from weights."""

import numpy as np
import pytest
import torch
from torch import nn

from pruneops.data import Split
from pruneops.models import ModelSpec, create_model
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.masks import apply_masks_, load_masks, make_permanent_, save_masks
from pruneops.pruning.methods import (
    METHODS,
    PruneContext,
    prunable_weights,
    semi_structured_available,
    semi_structured_mask,
)
from pruneops.training.fit import FitSettings, fit_

SHAPE = [1, 8, 8]


def _data(n=128, seed=0):
    rng = np.random.default_rng(seed)
    return Split(rng.random((n, *SHAPE), dtype=np.float32), (np.arange(n) % 10).astype(np.int64))


def _ctx(target, **kw):
    return PruneContext(
        target_ratio=target,
        criterion=IMPORTANCES.get(kw.pop("importance", "l1")),
        example_input=torch.zeros(1, *SHAPE),
        train=_data(),
        **kw,
    )


def _zero_fraction(weights):
    return sum(int((w == 0).sum()) for w in weights.values()) / sum(w.numel() for w in weights.values())


@pytest.mark.parametrize("scope", ["global", "layer"])
@pytest.mark.parametrize("target", [0.5, 0.9])
def test_magnitude_reaches_target_in_both_scopes(scope, target):
    model = create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [8, 16]}))
    method = METHODS.get("magnitude")(_ctx(target, scope=scope))
    method.apply_(model, 1.0)
    weights = prunable_weights(model)
    assert _zero_fraction(weights) == pytest.approx(target, abs=0.002)
    if scope == "layer":
        for w in weights.values():
            assert float((w == 0).float().mean()) == pytest.approx(target, abs=1.0 / w.numel() + 1e-6)
    for batch in (1, 4, 32):
        assert model(torch.zeros(batch, *SHAPE)).shape == (batch, 10)


def test_l1_and_l2_magnitude_rank_weights_alike():
    a = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32]}))
    b = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32]}))
    b.load_state_dict(a.state_dict())
    ma, mb = METHODS.get("magnitude")(_ctx(0.7, importance="l1")), METHODS.get("magnitude")(_ctx(0.7, importance="l2"))
    ma.apply_(a, 1.0)
    mb.apply_(b, 1.0)
    for name in ma.masks():
        assert torch.equal(ma.masks()[name], mb.masks()[name])


def test_layer_allocation_sets_each_layers_ratio():
    model = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32, 32]}))
    alloc = {"features.1.weight": 0.2, "features.4.weight": 0.8}
    METHODS.get("magnitude")(_ctx(0.5, layer_allocation=alloc)).apply_(model, 1.0)
    weights = prunable_weights(model)
    for name, ratio in alloc.items():
        assert float((weights[name] == 0).float().mean()) == pytest.approx(ratio, abs=0.01)


def test_masks_save_reapply_to_same_architecture_and_become_permanent(tmp_path):
    torch.manual_seed(0)
    model = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32]}))
    fresh = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32]}))
    fresh.load_state_dict(model.state_dict())
    method = METHODS.get("magnitude")(_ctx(0.6))
    method.apply_(model, 1.0)
    save_masks(method.masks(), tmp_path / "masks.safetensors")
    masks = load_masks(tmp_path / "masks.safetensors")
    assert all(m.dtype == torch.bool for m in masks.values())
    zeros = make_permanent_(fresh, masks)
    x = torch.randn(5, *SHAPE)
    torch.testing.assert_close(fresh.eval()(x), model.eval()(x))
    assert zeros["features.1.weight"] == pytest.approx(float((model.features[1].weight == 0).float().mean()))
    other = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [16]}))
    with pytest.raises(Exception, match="does not fit this architecture"):
        apply_masks_(other, masks)


def test_movement_scores_are_minus_weight_times_gradient():
    model = nn.Sequential(nn.Flatten(), nn.Linear(4, 2, bias=False), nn.Linear(2, 2))
    model.classifier = model[2]
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[3.0, 0.1, -2.0, 0.5], [1.0, -1.0, 0.2, 0.3]]))
    method = METHODS.get("movement")(PruneContext(0.5, IMPORTANCES.get("l1"), torch.zeros(1, 4), _data(4)))
    x, y = torch.randn(8, 4), torch.randint(0, 2, (8,))
    total = torch.zeros(2, 4)
    for _ in range(2):
        model.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        total -= model[1].weight.detach() * model[1].weight.grad
        method.after_backward(model)
    torch.testing.assert_close(method._scores["1.weight"], total)


def test_movement_prunes_weights_moving_to_zero_where_magnitude_keeps_them():
    model = nn.Sequential(nn.Flatten(), nn.Linear(2, 1, bias=False), nn.Linear(1, 1))
    model.classifier = model[2]
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[3.0, 0.1]]))
    movement = METHODS.get("movement")(PruneContext(0.5, IMPORTANCES.get("l1"), torch.zeros(1, 2), _data(2)))
    model[1].weight.grad = torch.tensor([[1.0, -1.0]])  # the loss pulls 3.0 towards 0 and 0.1 away
    movement.after_backward(model)
    movement.apply_(model, 1.0)
    assert model[1].weight[0].tolist() == pytest.approx([0.0, 0.1])
    with torch.no_grad():
        model[1].weight.copy_(torch.tensor([[3.0, 0.1]]))
    magnitude = METHODS.get("magnitude")(PruneContext(0.5, IMPORTANCES.get("l1"), torch.zeros(1, 2), _data(2)))
    magnitude.apply_(model, 1.0)
    assert model[1].weight[0].tolist() == pytest.approx([3.0, 0.0])


def test_movement_reaches_target_through_iterative_training():
    torch.manual_seed(0)
    model = create_model(ModelSpec("transformer", SHAPE, 10, {"dim": 16, "depth": 1, "ffn_dim": 32}))
    method = METHODS.get("movement")(_ctx(0.9))
    with pytest.raises(RuntimeError, match="no scores yet"):
        method.apply_(model, 1.0)
    train, val = _data(), _data(seed=1)
    for fraction in (0.5, 1.0):
        fit_(
            model,
            train,
            val,
            FitSettings(epochs=1, patience=5),
            after_backward=method.after_backward,
            after_step=method.after_step,
        )
        method.apply_(model, fraction)
    assert _zero_fraction(prunable_weights(model)) == pytest.approx(0.9, abs=0.002)
    for batch in (1, 7):
        assert model(torch.zeros(batch, *SHAPE)).shape == (batch, 10)


def test_semi_structured_keeps_two_of_every_four():
    torch.manual_seed(0)
    model = create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [32, 16]}))
    method = METHODS.get("semi_structured")(_ctx(0.5))
    method.apply_(model, 1.0)
    assert set(method.masks()) == {"features.1.weight", "features.4.weight"}
    for name in method.masks():
        w = dict(model.named_parameters())[name]
        blocks = (w.reshape(w.shape[0], -1, 4) != 0).sum(-1)
        assert int(blocks.max()) <= 2
        assert float((w == 0).float().mean()) == pytest.approx(0.5, abs=0.01)
    assert float((model.classifier.weight == 0).float().mean()) == 0.0
    if semi_structured_available():
        assert method.speedup.startswith("not available on CPU")
    for batch in (1, 9):
        assert model(torch.zeros(batch, *SHAPE)).shape == (batch, 10)


def test_semi_structured_mask_picks_largest_two():
    w = torch.tensor([[0.1, -5.0, 3.0, 0.2, 1.0, 2.0, -3.0, 4.0]])
    assert semi_structured_mask(w).tolist() == [[False, True, True, False, False, False, True, True]]


@pytest.mark.gpu
@pytest.mark.skipif(
    semi_structured_available() is not None, reason=f"2:4 kernels unavailable: {semi_structured_available()}"
)
def test_semi_structured_runs_on_cuda_with_parity():
    from pruneops.pruning.methods import to_semi_structured_

    class Net(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.body = nn.Linear(256, 256)
            self.classifier = nn.Linear(256, 10)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return self.classifier(torch.relu(self.body(x)))

    torch.manual_seed(0)
    # Not an nn.Sequential with a `classifier` attribute: that registers the head twice, and the
    # Sequential would run it twice.
    model = Net()
    method = METHODS.get("semi_structured")(PruneContext(0.5, IMPORTANCES.get("l1"), torch.zeros(1, 256), _data(2)))
    method.apply_(model, 1.0)
    # The kernels exist here, but no speed-up is claimed: docs/results/gpu measured them slower than dense.
    assert method.speedup.startswith("none claimed")
    model = model.half().cuda().eval()
    x = torch.randn(64, 256, device="cuda", dtype=torch.half)
    dense = model(x)
    assert to_semi_structured_(model, method.masks()) == ["body.weight"]
    torch.testing.assert_close(model(x), dense, atol=1e-2, rtol=1e-2)
