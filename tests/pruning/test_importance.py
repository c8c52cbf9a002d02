"""Importance criteria do what they say: Taylor uses gradients, and nothing is swapped quietly."""

import numpy as np
import pytest
import torch

from pruneops.core.errors import PruneOpsError
from pruneops.data import Split
from pruneops.models import ModelSpec, create_model
from pruneops.planning.sensitivity import sweep_units
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import accumulate_grads_
from pruneops.pruning.units import UnitPruner
from pruneops.training.fit import clone_with_grads, evaluate

SHAPE = [1, 8, 8]


def _data(n=256, seed=0):
    rng = np.random.default_rng(seed)
    return Split(rng.random((n, *SHAPE), dtype=np.float32), (np.arange(n) % 10).astype(np.int64))


def _mlp():
    torch.manual_seed(0)
    return create_model(ModelSpec("mlp", SHAPE, 10, {"hidden": [16], "dropout": 0.0}))


def test_taylor_matches_hand_computed_w_times_grad_and_ranks_unlike_l2():
    model, data = _mlp(), _data()
    accumulate_grads_(model, data, batches=4, batch_size=64)
    hidden, head = model.features[1], model.classifier
    w1, g1, w2, g2 = hidden.weight, hidden.weight.grad, head.weight, head.weight.grad
    # Molchanov et al.: |w * dL/dw| per weight, summed per channel; the group's layers averaged.
    hand = ((w1 * g1).abs().sum(1) + (w2 * g2).abs().sum(0)) / 2
    pruner = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("taylor"))
    taylor = pruner.scores("features.1")
    torch.testing.assert_close(taylor / taylor.sum(), hand / hand.sum(), rtol=1e-5, atol=1e-7)
    l2 = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("l2")).scores("features.1")
    assert not torch.equal(torch.argsort(taylor), torch.argsort(l2))


def test_taylor_without_gradients_is_an_error_not_l2():
    model = _mlp()  # no backward pass: no .grad
    pruner = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("taylor"))
    with pytest.raises(PruneOpsError, match="importance 'taylor' cannot score unit features.1: .* no gradient"):
        pruner.prune_to_({"features.1": 8})


def test_copies_for_sensitivity_trials_keep_the_gradients():
    model, data = _mlp(), _data()
    accumulate_grads_(model, data, batches=2, batch_size=64)
    twin = clone_with_grads(model)
    for a, b in zip(model.parameters(), twin.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)
        assert a.grad.data_ptr() != b.grad.data_ptr()


def test_sensitivity_sweep_with_taylor_prunes_by_gradients(monkeypatch):
    model, data = _mlp(), _data()
    accumulate_grads_(model, data, batches=4, batch_size=64)
    kept = {}
    original = UnitPruner.prune_to_

    def spy(self, keep, head_scores=None):
        original(self, keep, head_scores)
        kept[self.criterion.name] = self.model.features[1].weight.detach().clone()

    monkeypatch.setattr(UnitPruner, "prune_to_", spy)
    baseline = evaluate(model, data)
    for name in ("taylor", "l2"):
        sweep_units(model, data, IMPORTANCES.get(name), [0.5], SHAPE, 256, baseline)
    assert kept["taylor"].shape == kept["l2"].shape == (8, 64)
    assert not torch.equal(kept["taylor"], kept["l2"])  # different channels kept: gradients were used


def test_a_criterion_that_cannot_score_a_unit_is_recorded_as_a_warning():
    model = _mlp()  # no BatchNorm anywhere
    pruner = UnitPruner(model, torch.zeros(1, *SHAPE), IMPORTANCES.get("bn_scale"))
    pruner.prune_to_({"features.1": 8})
    assert model.features[1].out_features == 8
    assert pruner.warnings == [
        "importance 'bn_scale' cannot score unit features.1 (no layer it understands): ranked by L2 norm instead"
    ]
