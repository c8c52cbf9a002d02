"""Timing on this machine: exports and the one-operator table in the form asked, the CPU's identity, timing copies."""

from __future__ import annotations

import pytest
import torch

from pruneops.models import ModelSpec, create_model
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner
from pruneops.runtimes.onnxruntime.layers import LatencyTable, LayerShape
from tests.planning.latency_cases import SHAPE


@pytest.mark.parametrize(
    ("form", "int8_ops"),
    [("fp32", set()), ("static", {"QuantizeLinear", "DequantizeLinear"}), ("dynamic", {"ConvInteger"})],
)
def test_measured_latency_times_each_export_in_the_form_asked(monkeypatch, form, int8_ops):
    """An INT8 form times the quantize stage's graph of each export, not the fp32 export."""
    import onnx

    from pruneops.config import BenchmarkConfig
    from pruneops.runtimes.onnxruntime import files as onnx_utils
    from pruneops.runtimes.onnxruntime.timing import measured_latency

    timed_ops = []
    make_session = onnx_utils.make_session

    def spy(path, threads=1):
        timed_ops.append({node.op_type for node in onnx.load(str(path)).graph.node})
        return make_session(path, threads)

    monkeypatch.setattr(onnx_utils, "make_session", spy)
    models = {
        "dense": create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [16, 32]})).eval(),
        "narrow": create_model(ModelSpec("cnn", SHAPE, 10, {"widths": [8, 16]})).eval(),
    }
    timing = BenchmarkConfig(threads=1, batch_sizes=[1, 4], warmup=1, repeats=3, rounds=1)
    times = measured_latency(models, SHAPE, timing, form=form)
    assert len(timed_ops) == 2
    for ops in timed_ops:
        assert int8_ops <= ops
        if form == "fp32":
            assert not {"QuantizeLinear", "ConvInteger", "DynamicQuantizeLinear"} & ops
    assert all(ms > 0 for per in times.values() for ms in per.values()) and set(times["dense"]) == {1, 4}


@pytest.mark.parametrize(
    ("form", "int8_ops"),
    [("fp32", set()), ("static", {"QuantizeLinear", "DequantizeLinear"}), ("dynamic", {"ConvInteger"})],
)
def test_the_one_operator_table_is_timed_in_the_form_asked(monkeypatch, form, int8_ops):
    """Each form gets its own entries, timed on the layer graph quantized as the quantize stage would."""
    import onnx

    from pruneops.runtimes.onnxruntime import layers as latency_module

    timed_ops = []

    def spy(model, feed, threads, repeats, warmup):
        proto = onnx.load_from_string(model) if isinstance(model, bytes) else onnx.load(model)
        timed_ops.append({node.op_type for node in proto.graph.node})
        return 1.0

    monkeypatch.setattr(latency_module, "time_model_bytes", spy)
    table = LatencyTable({"threads": 1})
    shape = LayerShape("conv", 16, 16, 1, (3, 3), (1, 1), (1, 1), (1, 1), (8, 8))
    table.layer_ms(shape, 1, form)
    assert int8_ops <= timed_ops[0]  # the layer graph; the overhead graph (a Relu) stays fp32
    if form == "fp32":
        assert "QuantizeLinear" not in timed_ops[0] and timed_ops[1] == {"Relu"}
    table.layer_ms(shape, 1, "fp32" if form != "fp32" else "static")
    assert table.measured == 2  # the other form is its own entry, measured again
    # Large batches calibrate in smaller batches than the graph's (a fixed batch of 64 refused 32).
    for layer in (shape, LayerShape("linear", 32, 10)):
        table.layer_ms(layer, 64, form)
    assert table.measured == 4


def test_a_table_from_another_cpu_generation_under_the_same_name_is_measured_again(tmp_path, monkeypatch):
    from pruneops.timing import machine as benchmark
    from pruneops.timing.machine import machine_fingerprint

    path = tmp_path / "latency_table.json"
    LatencyTable(machine_fingerprint(1), {"k": 0.1}).save(path)
    assert LatencyTable.load(path, machine_fingerprint(1))[1]
    # A virtual machine's /proc/cpuinfo named a Zen 3 and a Zen 4 both "AMD EPYC": whichever of
    # the two this machine is not (on a Zen 3 the Zen 3's features were no other generation).
    zen3, zen4 = "family 25 model 1: avx2 fma", "family 25 model 17: avx2 fma avx512f avx512bw avx512_vnni"
    other = zen4 if benchmark.cpu_features() == zen3 else zen3
    monkeypatch.setattr(benchmark, "cpu_features", lambda: other)
    table, same = LatencyTable.load(path, machine_fingerprint(1))
    assert not same and table.entries == {}


def test_cpu_features_name_the_generation_and_the_extensions_kernels_use(tmp_path):
    from pruneops.timing.machine import cpu_features

    x86 = tmp_path / "x86"
    x86.write_text(
        "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 17\nmodel name\t: AMD EPYC\n"
        "flags\t\t: fpu sse2 avx avx2 fma avx512f avx512_vnni sha_ni\n\nprocessor\t: 1\ncpu family\t: 25\n"
    )
    assert cpu_features(x86) == "family 25 model 17: avx2 fma avx512f avx512_vnni"
    arm = tmp_path / "arm"
    arm.write_text("processor\t: 0\nFeatures\t: fp asimd evtstrm aes asimddp i8mm\nCPU part\t: 0xd0c\n")
    assert cpu_features(arm) == "asimd asimddp i8mm"
    assert cpu_features(tmp_path / "missing") == ""


def test_timing_copies_drop_the_vocabulary_but_compute_the_same():
    transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
    from pruneops.core.inputs import example_arrays, text_inputs
    from pruneops.models.hf import SequenceLogits
    from pruneops.planning.latency_model import VOCABULARY_ROWS, without_vocabulary

    config = transformers.BertConfig(
        vocab_size=5000, hidden_size=32, num_hidden_layers=1, num_attention_heads=4, intermediate_size=48
    )
    torch.manual_seed(0)
    model = SequenceLogits(transformers.BertForSequenceClassification(config).eval())
    lean = without_vocabulary(model)
    word = lean.model.bert.embeddings.word_embeddings
    assert word.weight.shape == (VOCABULARY_ROWS, 32) and word.num_embeddings == VOCABULARY_ROWS
    assert model.model.bert.embeddings.word_embeddings.num_embeddings == 5000  # the model itself is untouched
    # Position embeddings (512 rows) stay: they are looked up by position, not by token.
    assert lean.model.bert.embeddings.position_embeddings.num_embeddings == 512
    feed = {k: torch.from_numpy(v) for k, v in example_arrays(text_inputs(), 2, {"seq": 10}).items()}
    with torch.no_grad():
        torch.testing.assert_close(lean(**feed), model(**feed), rtol=0, atol=0)

    # The whole latency model on it, from an example of real ids beyond the rows kept (the bench
    # crashed there once: the timing copies were pruned on the example as it was).
    from pruneops.planning.latency_model import build_latency_model
    from pruneops.timing.machine import machine_fingerprint

    model._pruneops_inputs = text_inputs()
    example = {"input_ids": torch.tensor([[4999, 1500, 7, 0]]), "attention_mask": torch.ones(1, 4, dtype=torch.long)}
    units = [(n, u.size) for n, u in UnitPruner(model, example, IMPORTANCES.get("l2")).units().items()]
    latency = build_latency_model(model, example, [4], units, LatencyTable(machine_fingerprint(1)), [1])
    assert {n for n, _ in units} == set(latency.units) and len(latency.exports["points"]) > 1 + len(units)
    assert latency.predict({}, 1) > 0
