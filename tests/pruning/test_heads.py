"""Attention-head and FFN pruning: gate importance, physical removal, HF BERT save/reload."""

import numpy as np
import pytest
import torch

from pruneops.data import Split
from pruneops.models import ModelSpec, create_model
from pruneops.models.profiling import count_macs, count_params
from pruneops.pruning.heads import gate_importance, head_sites, remove_heads_
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.methods import METHODS, PruneContext
from pruneops.pruning.units import UnitPruner

SHAPE = [1, 8, 8]


def _data(n=64, seed=0):
    rng = np.random.default_rng(seed)
    return Split(rng.random((n, *SHAPE), dtype=np.float32), (np.arange(n) % 10).astype(np.int64))


def test_gate_importance_is_normalised_and_zero_for_a_dead_head():
    torch.manual_seed(0)
    model = create_model(ModelSpec("transformer", SHAPE, 10, {"dropout": 0.0}))
    site = head_sites(model)["layers.0.attn"]
    with torch.no_grad():
        site.out.weight[:, 2 * site.head_dim : 3 * site.head_dim] = 0.0  # head 2 contributes nothing
    data = _data()
    batches = [(torch.from_numpy(data.x[i : i + 16]), torch.from_numpy(data.y[i : i + 16])) for i in range(0, 64, 16)]
    scores = gate_importance(model, head_sites(model), batches)
    for s in scores.values():
        assert float(s.norm()) == pytest.approx(1.0, abs=1e-5)
    assert float(scores["layers.0.attn"][2]) == pytest.approx(0.0, abs=1e-7)
    assert int(torch.argmin(scores["layers.0.attn"])) == 2
    assert all(p.grad is None for p in model.parameters())


def test_head_method_removes_heads_and_ffn_neurons():
    torch.manual_seed(0)
    model = create_model(ModelSpec("transformer", SHAPE, 10))
    macs, params = count_macs(model, SHAPE), count_params(model)
    ctx = PruneContext(0.5, IMPORTANCES.get("l2"), torch.zeros(1, *SHAPE), _data())
    METHODS.get("head")(ctx).apply_(model, 1.0)
    assert [layer.attn.num_heads for layer in model.layers] == [2, 2]
    assert [layer.ffn[0].out_features for layer in model.layers] == [64, 64]
    assert count_macs(model, SHAPE) < 0.6 * macs and count_params(model) < params
    for batch in (1, 5):
        assert model(torch.zeros(batch, *SHAPE)).shape == (batch, 10)


transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")


def _tiny_bert():
    from transformers import BertConfig, BertForSequenceClassification

    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=60,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        intermediate_size=48,
        max_position_embeddings=16,
        num_labels=3,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    return BertForSequenceClassification(config).eval()


class Logits(torch.nn.Module):
    """Tensor in, logits out: what tracing and our methods expect."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, ids):
        return self.model(input_ids=ids).logits


def test_bert_heads_found_and_removed_with_identical_outputs_when_zeroed():
    bert = _tiny_bert()
    sites = head_sites(bert)
    assert list(sites) == ["bert.encoder.layer.0.attention.self", "bert.encoder.layer.1.attention.self"]
    site = sites["bert.encoder.layer.1.attention.self"]
    with torch.no_grad():
        site.out.weight[:, 0 : site.head_dim] = 0.0
    ids = torch.randint(0, 60, (3, 10))
    before = bert(input_ids=ids).logits
    remove_heads_(site, [0])
    attention = bert.bert.encoder.layer[1].attention.self
    assert attention.num_attention_heads == 3 and attention.all_head_size == 24
    assert (
        attention.query.weight.shape == (24, 32) and bert.bert.encoder.layer[1].attention.output.dense.in_features == 24
    )
    torch.testing.assert_close(bert(input_ids=ids).logits, before, atol=1e-5, rtol=1e-4)


def test_bert_gate_importance_head_and_ffn_pruning_save_and_reload(tmp_path):
    from transformers import BertForSequenceClassification

    from pruneops.models.hf import load_pruned_hf, save_pruned_hf

    bert = _tiny_bert()
    wrapped = Logits(bert)
    ids = torch.randint(0, 60, (8, 10))
    labels = torch.randint(0, 3, (8,))
    scores = gate_importance(wrapped, head_sites(wrapped), [(ids, labels)])
    pruner = UnitPruner(wrapped, ids[:1], IMPORTANCES.get("l2"))
    units = pruner.units()
    assert units["model.bert.encoder.layer.0.attention.self.heads"].size == 4
    assert units["model.bert.encoder.layer.0.intermediate.dense"].size == 48
    params = count_params(bert)
    pruner.prune_to_(
        {
            "model.bert.encoder.layer.0.attention.self.heads": 1,
            "model.bert.encoder.layer.1.attention.self.heads": 3,
            "model.bert.encoder.layer.0.intermediate.dense": 20,
        },
        head_scores=scores,
    )
    kept = bert.bert.encoder.layer[0].attention.self
    assert kept.num_attention_heads == 1 and bert.bert.encoder.layer[0].intermediate.dense.out_features == 20
    assert count_params(bert) < params
    logits = bert(input_ids=ids).logits
    save_pruned_hf(bert, tmp_path / "pruned")
    reloaded = load_pruned_hf(tmp_path / "pruned", BertForSequenceClassification)
    torch.testing.assert_close(reloaded(input_ids=ids).logits, logits)
    assert reloaded.bert.encoder.layer[1].attention.self.num_attention_heads == 3
    assert reloaded.config.num_attention_heads == 4  # the config keeps the original; shapes are per layer
