"""Head and FFN pruning on HuggingFace encoders other than BERT, found from their structure.

Each family is a tiny randomly initialised config (no downloads): its heads are found, removing a
head whose output is zeroed leaves the logits unchanged (so the right rows, columns and tied bias
columns go), and the pruned model exports to ONNX with int64 ids + mask (dynamic batch and
sequence) and reloads with identical logits.
"""

import numpy as np
import pytest
import torch

from pruneops.core.errors import PruneOpsError
from pruneops.core.inputs import text_inputs
from pruneops.pruning.heads import gate_importance, head_sites
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session

transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")

from pruneops.models.hf import SequenceLogits, input_specs, load_pruned_hf, save_pruned_hf  # noqa: E402

VOCAB, HIDDEN, HEADS, FFN = 60, 32, 4, 48
COMMON = {
    "vocab_size": VOCAB,
    "hidden_size": HIDDEN,
    "num_hidden_layers": 2,
    "num_attention_heads": HEADS,
    "intermediate_size": FFN,
    "max_position_embeddings": 40,
    "num_labels": 3,
    "hidden_dropout_prob": 0.0,
    "attention_probs_dropout_prob": 0.0,
}
DISTILBERT = {
    "vocab_size": VOCAB,
    "dim": HIDDEN,
    "n_layers": 2,
    "n_heads": HEADS,
    "hidden_dim": FFN,
    "max_position_embeddings": 40,
    "num_labels": 3,
    "dropout": 0.0,
    "attention_dropout": 0.0,
}
# family: (config class, model class, config kwargs, head units expected, FFN units expected)
FAMILIES = {
    "bert": ("BertConfig", "BertForSequenceClassification", COMMON, 2, "intermediate.dense"),
    "roberta": ("RobertaConfig", "RobertaForSequenceClassification", {**COMMON, "pad_token_id": 1}, 2, None),
    "electra": ("ElectraConfig", "ElectraForSequenceClassification", {**COMMON, "embedding_size": HIDDEN}, 2, None),
    # MPNet adds one relative-position bias (a column per head) in every layer: one tied unit.
    "mpnet": ("MPNetConfig", "MPNetForSequenceClassification", COMMON, 1, None),
    "distilbert": ("DistilBertConfig", "DistilBertForSequenceClassification", DISTILBERT, 2, "ffn.lin1"),
}


def _model(family: str):
    config_cls, model_cls, kwargs, *_ = FAMILIES[family]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, config_cls)(**kwargs)).eval()
    return model, getattr(transformers, model_cls)


def _batch(seq: int = 12, batch: int = 3, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(3, VOCAB, (batch, seq), generator=g)
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[1, seq // 2 :] = 0  # one padded row: the mask must reach every kept head
    return {"input_ids": ids, "attention_mask": mask}


def _logits(model, batch) -> torch.Tensor:
    with torch.no_grad():
        return SequenceLogits(model)(batch["input_ids"], batch["attention_mask"])


def _head_units(pruner: UnitPruner) -> dict[str, int]:
    return {n: u.size for n, u in pruner.units().items() if u.kind == "heads"}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_heads_are_found_from_the_structure_and_qkv_is_never_a_channel_unit(family):
    model, _ = _model(family)
    wrapped = SequenceLogits(model)
    units = UnitPruner(wrapped, _batch()["input_ids"][:1], IMPORTANCES.get("l2")).units()
    heads = {n: u.size for n, u in units.items() if u.kind == "heads"}
    assert len(heads) == FAMILIES[family][3] and set(heads.values()) == {HEADS}
    sites = head_sites(wrapped)
    projections = {id(layer) for s in sites.values() for layer in (*s.projections, s.out)}
    by_name = dict(wrapped.named_modules())
    channel_roots = [n for n, u in units.items() if u.kind == "channels"]
    assert not any(id(by_name[n]) in projections for n in channel_roots)
    ffn = FAMILIES[family][4]
    if ffn:
        assert sum(n.endswith(ffn) for n in channel_roots) == 2


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_removing_a_silent_head_leaves_the_logits_unchanged(family):
    model, _ = _model(family)
    wrapped = SequenceLogits(model)
    sites = head_sites(wrapped)
    silent = 2
    with torch.no_grad():
        for site in sites.values():  # head 2 of every layer contributes nothing
            site.out.weight[:, silent * site.head_dim : (silent + 1) * site.head_dim] = 0.0
        for module in model.modules():  # a per-head bias large enough that a wrong column shows
            if isinstance(module, torch.nn.Embedding) and module.embedding_dim == HEADS:
                module.weight.normal_(0.0, 2.0)
    batch = _batch()
    before = _logits(model, batch)
    pruner = UnitPruner(wrapped, batch["input_ids"][:1], IMPORTANCES.get("l2"))
    scores = {n: torch.tensor([1.0, 1.0, 0.0, 1.0]) for n in sites}  # ranks head 2 last everywhere
    pruner.prune_to_({n: HEADS - 1 for n in _head_units(pruner)}, head_scores=scores)
    assert all(s.num_heads == HEADS - 1 for s in head_sites(wrapped).values())
    torch.testing.assert_close(_logits(model, batch), before, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_pruned_model_exports_with_int64_ids_and_reloads_identically(family, tmp_path):
    model, model_cls = _model(family)
    wrapped = SequenceLogits(model)
    batch = _batch()
    pruner = UnitPruner(wrapped, batch["input_ids"][:1], IMPORTANCES.get("l2"))
    units = pruner.units()
    keep = {n: 1 if u.kind == "heads" else u.size // 2 for n, u in units.items() if "classifier" not in n}
    pruner.prune_to_(keep)
    assert {s.num_heads for s in head_sites(wrapped).values()} == {1}
    logits = _logits(model, batch)

    specs = input_specs(model)
    assert [s.name for s in specs][:2] == ["input_ids", "attention_mask"]
    path = tmp_path / "pruned.onnx"
    export_onnx_file(wrapped, text_inputs(), path, opset=18, sizes={"seq": 12})
    session = make_session(path)
    assert [(i.name, i.type) for i in session.get_inputs()] == [
        ("input_ids", "tensor(int64)"),
        ("attention_mask", "tensor(int64)"),
    ]
    for seq, n in ((12, 3), (7, 5)):  # other batch and sequence lengths than the export's
        other = _batch(seq, n, seed=seq)
        got = session.run(None, {k: v.numpy() for k, v in other.items()})[0]
        np.testing.assert_allclose(got, _logits(model, other).numpy(), atol=1e-4, rtol=1e-3)

    save_pruned_hf(model, tmp_path / "hf")
    reloaded = load_pruned_hf(tmp_path / "hf", model_cls)
    torch.testing.assert_close(_logits(reloaded, batch), logits)


def test_albert_shared_attention_is_refused_with_the_reason():
    from transformers import AlbertConfig, AlbertForSequenceClassification

    torch.manual_seed(0)
    albert = AlbertForSequenceClassification(AlbertConfig(**COMMON, embedding_size=16)).eval()
    pruner = UnitPruner(SequenceLogits(albert), _batch()["input_ids"][:1], IMPORTANCES.get("l2"))
    with pytest.raises(PruneOpsError, match=r"runs 2 times per forward .*shared by several layers"):
        pruner.units()
    with pytest.raises(PruneOpsError, match="shared"):
        pruner.prune_to_({"model.albert.pooler": 8})


def test_attention_no_adapter_understands_is_refused():
    class OddAttention(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.num_heads = 4
            self.a, self.b, self.c = torch.nn.Linear(8, 8), torch.nn.Linear(8, 16), torch.nn.Linear(16, 8)

        def forward(self, x):
            return self.c(self.b(self.a(x)))

    with pytest.raises(PruneOpsError, match="looks like attention .*no attention adapter understands it"):
        head_sites(torch.nn.Sequential(OddAttention()))


def test_gate_importance_of_a_model_without_heads_is_empty():
    model = torch.nn.Sequential(torch.nn.Linear(4, 3))
    assert gate_importance(model, head_sites(model), [(torch.zeros(2, 4), torch.zeros(2, dtype=torch.long))]) == {}


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_macs_include_the_attention_matmuls_as_torch_counts_them(family):
    from torch.utils.flop_counter import FlopCounterMode

    from pruneops.models.profiling import count_macs

    model, _ = _model(family)
    wrapped = SequenceLogits(model)
    wrapped._pruneops_inputs = text_inputs()  # what create_model records for a text model
    seq = 24
    # torch's counter has no formula for the CPU SDPA kernel: count the reference on eager attention.
    model.set_attn_implementation("eager")
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        wrapped(torch.ones(1, seq, dtype=torch.long), torch.ones(1, seq, dtype=torch.long))
    reference = counter.get_total_flops() / 2  # torch counts a multiply-add as 2 FLOPs
    ours = count_macs(wrapped, [seq])
    linear_only = ours - 2 * 2 * seq * seq * HIDDEN  # 2 layers x (QK^T + AV)
    assert ours == pytest.approx(reference, rel=0.01)
    assert linear_only < 0.9 * reference  # without the matmuls the count would be well short
