"""The retraining-free method's two parts on HuggingFace encoders (tiny random configs, no downloads).

- Fisher scores: a head or FFN neuron whose output is zero cannot change the loss, so its mask
  gradient is exactly zero on every sample; live ones are not.
- Least-squares refit: when a removed head or neuron duplicates a kept one (inputs and output
  columns), the layer's dense output is exactly reachable by scaling what is kept (the kept
  one's columns doubled); the refit
  must find it (logits back to dense to float round-off), where plain removal leaves an error.
"""

import copy

import pytest
import torch

from pruneops.pruning.fisher import fisher_scores, reconstruct_linears_
from pruneops.pruning.heads import head_sites
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from tests.pruning.test_hf_families import FAMILIES, _batch, _model

pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")

from pruneops.models.hf import SequenceLogits  # noqa: E402

UNTIED = sorted(f for f in FAMILIES if f != "mpnet")  # MPNet's heads are one unit over all layers


def _wrapped(family: str):
    model, _ = _model(family)
    wrapped = SequenceLogits(model).eval()
    pruner = UnitPruner(wrapped, _batch()["input_ids"][:1], IMPORTANCES.get("l2"))
    return wrapped, pruner


def _batches(n: int = 8) -> list[tuple[dict, torch.Tensor]]:
    return [(_batch(seed=i), torch.tensor([0, 1, 2])) for i in range(n)]


def _logits(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([model(**x) for x, _ in batches])


def _ffn(pruner: UnitPruner):
    """The first FFN unit (the widest consumed channels): its name, the Linear whose rows are its
    neurons, and their consumer."""
    consumers = pruner.linear_consumers()
    name = max(consumers, key=lambda n: consumers[n].in_features)
    return name, dict(pruner.model.named_modules())[name], consumers[name]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_fisher_score_is_zero_exactly_for_a_silent_head_and_neuron(family):
    model, pruner = _wrapped(family)
    sites = head_sites(model)
    site_name, site = next(iter(sites.items()))
    unit, producer, consumer = _ffn(pruner)
    d = site.head_dim
    with torch.no_grad():
        v = site.projections[-1]  # V: a head with zero values has a zero context
        v.weight[2 * d : 3 * d] = 0
        v.bias[2 * d : 3 * d] = 0
        consumer.weight[:, 5] = 0  # neuron 5 reaches nothing
    heads, channels = fisher_scores(model, sites, pruner.linear_consumers(), _batches(4))
    assert heads[site_name][2] == 0 and (heads[site_name][[0, 1, 3]] > 0).all()
    assert channels[unit][5] == 0 and (channels[unit] > 0).sum() == producer.out_features - 1


@pytest.mark.parametrize("family", UNTIED)
def test_least_squares_refit_recovers_removed_duplicates_exactly(family):
    model, pruner = _wrapped(family)
    sites = head_sites(model)
    site_name, site = next(iter(sites.items()))
    unit, producer, consumer = _ffn(pruner)
    d, extra = site.head_dim, producer.out_features - 40
    with torch.no_grad():  # head 3 repeats head 1; neurons 40.. repeat neurons 0.., outputs too
        for proj in site.projections:
            proj.weight[3 * d : 4 * d] = proj.weight[d : 2 * d]
            proj.bias[3 * d : 4 * d] = proj.bias[d : 2 * d]
        site.out.weight[:, 3 * d : 4 * d] = site.out.weight[:, d : 2 * d]
        producer.weight[40:] = producer.weight[:extra]
        producer.bias[40:] = producer.bias[:extra]
        consumer.weight[:, 40:] = consumer.weight[:, :extra]
    dense = copy.deepcopy(model)
    batches = _batches()
    reference = _logits(dense, batches)
    head_rank = {site_name: torch.tensor([4.0, 3.0, 2.0, 1.0])}  # head 3 lowest
    channel_rank = {unit: -torch.arange(producer.out_features, dtype=torch.float)}  # 40.. lowest
    pruner.prune_to_({f"{site_name}.heads": 3, unit: 40}, head_scores=head_rank, channel_scores=channel_rank)
    scale = reference.abs().max().item()  # a random classifier's logits are small: errors relative to them
    removed = (_logits(model, batches) - reference).abs().max().item() / scale
    gains = reconstruct_linears_(model, dense, [x for x, _ in batches], ridge=1e-9)
    refit = (_logits(model, batches) - reference).abs().max().item() / scale
    # Removal moves the logits by 0.3-0.7% of their scale in these configs; float32 round-off
    # after an exact refit is ~1e-7 of it.
    assert removed > 1e-3, "removing the duplicates should change the logits before the refit"
    assert refit < 1e-5, f"refit left {refit:.2e} (before: {removed:.2e}); per layer {gains}"
    assert len(gains) == 2 and max(gains.values()) < 1e-6
