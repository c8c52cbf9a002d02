"""The decoder path of the pipeline: params validated across sections, a failing corpus writes nothing,
its dvc.yaml plots. `dvc repro` of it and the loop after: tests/flows/test_decoder_reprune.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pruneops.cli import main  # noqa: E402
from pruneops.pipeline.stages import load_configs  # noqa: E402
from tests.conftest import write_params  # noqa: E402
from tests.decoder_helpers import decoder_params, save_tiny, speeches  # noqa: E402


@pytest.fixture
def corpus_params(tmp_path):
    (tmp_path / "corpus.txt").write_text("\n\n".join(speeches(120)))
    return decoder_params(tmp_path / "model", tmp_path / "corpus.txt")


def _one_line_error(params: dict, directory: Path, capsys) -> str:
    write_params(directory, params)
    assert main(["--params", str(directory / "params.yaml"), "validate"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    return err[0]


def test_the_decoder_params_validate(corpus_params):
    configs = load_configs(corpus_params)
    assert configs["train"].task == "causal_lm" and configs["validate"].dataset == "corpus"
    assert configs["prune"].decoder.importance == "activation"


@pytest.mark.parametrize(
    ("section", "change", "named"),
    [
        ("validate", {"dataset": "digits"}, "train.task"),
        ("train", {"epochs": 3}, "pretrain"),
        ("quantize", {"method": "static"}, "quantize.method"),
        ("prune", {"target": {"kind": "ratio", "value": 0.5}}, "prune.target"),
        ("prune", {"decoder": {"importance": "l2"}}, "importance"),
        ("prune", {"target": {"kind": "latency_ratio", "value": 0.7, "form": "dynamic"}}, "prune.target.form"),
    ],
)
def test_a_decoder_params_mistake_is_one_line(corpus_params, tmp_path, capsys, section, change, named):
    corpus_params[section] = {**corpus_params[section], **change}
    assert named in _one_line_error(corpus_params, tmp_path, capsys)


@pytest.mark.parametrize(
    ("target", "dense_ms", "ratio"),
    [
        ({"kind": "latency_ratio", "value": 0.7}, 20.0, 0.7),
        ({"kind": "latency_ms", "value": 12.0}, 20.0, 0.6),
        ({"kind": "latency_ms", "value": 300.0, "metric": "prefill"}, 400.0, 0.75),
    ],
)
def test_a_latency_target_is_a_fraction_of_dense_time(corpus_params, target, dense_ms, ratio):
    from pruneops.task.causal_lm.prune import target_ratio

    corpus_params["prune"] = {**corpus_params["prune"], "target": target}
    assert target_ratio(load_configs(corpus_params)["prune"], dense_ms) == pytest.approx(ratio, rel=1e-12)


def test_a_latency_ms_target_dense_already_meets_is_refused(corpus_params):
    from pruneops.core.errors import ConfigError
    from pruneops.task.causal_lm.prune import target_ratio

    corpus_params["prune"] = {**corpus_params["prune"], "target": {"kind": "latency_ms", "value": 25.0}}
    with pytest.raises(ConfigError, match=r"25 ms.*not below the dense model's 20.00"):
        target_ratio(load_configs(corpus_params)["prune"], 20.0)


def test_a_corpus_that_fails_its_expectations_writes_nothing(tmp_path):
    from pruneops.core.errors import DataValidationError
    from pruneops.core.io import Layout
    from pruneops.pipeline.stages import get_stage

    save_tiny("llama", tmp_path / "model")
    documents = speeches(40)
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents + ["the"] * 3))  # three one-word documents
    params = decoder_params(tmp_path / "model", tmp_path / "corpus.txt")
    params["validate"].update(min_text_chars=20, drop_duplicates=False, max_duplicate_fraction=0.5)
    with pytest.raises(DataValidationError, match="n_chars"):
        get_stage("validate").run(load_configs(params), Layout(tmp_path))
    assert not (tmp_path / "artifacts" / "validate").exists()


def test_dvc_yaml_of_a_decoder_project_plots_the_rows_its_stages_write(corpus_params, tmp_path):
    from pruneops.pipeline.dvcfile import render

    write_params(tmp_path, corpus_params)
    stages = render(tmp_path)["stages"]

    def axes(stage: str, file: str) -> tuple[str, str]:
        entry = next(p[f"plots/{stage}/{file}"] for p in stages[stage]["plots"] if f"plots/{stage}/{file}" in p)
        return entry["x"], entry["y"]

    assert axes("benchmark", "frontier.json") == ("latency_b1_ms", "test_perplexity")
    assert axes("finetune", "history.json") == ("tokens", "loss")
    assert axes("sensitivity", "curves.json") == ("layer", "perplexity_increase")
    assert axes("prune", "history.json") == ("step", "search_perplexity")


@pytest.mark.parametrize(
    ("section", "key", "value", "message"),
    [
        ("prune", "target", {"kind": "latency_ratio", "value": 0.7, "metric": "prefill"}, "prune.target.metric"),
        ("finetune", "compute_dtype", "bf16", "finetune.compute_dtype"),
        ("finetune", "lora_rank", 8, "finetune.lora_rank"),
    ],
)
def test_a_causal_lm_setting_is_refused_for_a_classifier(section, key, value, message):
    from pruneops.core.errors import ConfigError
    from pruneops.core.params import read_params

    params = read_params(Path(__file__).parents[3] / "params.yaml")
    params[section][key] = value
    with pytest.raises(ConfigError, match=f"{message}: applies to a causal LM"):
        load_configs(params)


def _reference_timings(ttft: dict[str, float], tpot: dict[str, float]):
    """A stand-in for `time_generation`: the given medians of each named folder."""
    from pruneops.runtimes.genai.generation import GenerationTiming

    def timed(folders, prompt, new_tokens, rounds):
        return {n: GenerationTiming(ttft[n], tpot[n], (tpot[n],), prompt.shape[1], new_tokens, 1) for n in folders}

    return timed


@pytest.mark.parametrize(
    ("metric", "value", "min_speedup", "planned", "held"),
    [
        ("decode", 1.0, 1.05, 0.7, False),  # as fast as a reference that decodes in 0.7 of dense's time
        ("decode", 0.9, 1.05, 0.63, False),
        ("prefill", 1.0, 1.05, 0.8, False),  # the prefill target goes by the time to first token
        ("decode", 1.5, 1.05, 1 / 1.05, True),  # 1.05 of dense: held to what the gate lets pass
        ("decode", 1.5, None, 1.0, True),
    ],
)
def test_a_reference_target_is_planned_as_its_measured_ratio_of_dense(
    corpus_params, tmp_path, monkeypatch, metric, value, min_speedup, planned, held
):
    import numpy as np

    from pruneops.core.io import Layout
    from pruneops.task.causal_lm import prune as prune_stage

    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "model.onnx").write_bytes(b"")
    (tmp_path / "served" / "genai_config.json").write_text("{}")
    target = {"kind": "latency_ratio", "value": value, "metric": metric, "reference": "served/model.onnx"}
    corpus_params["prune"] = {**corpus_params["prune"], "target": target, "gate": {"min_speedup": min_speedup}}
    config, benchmark = (load_configs(corpus_params)[k] for k in ("prune", "benchmark"))
    from pruneops.runtimes.genai import RUNTIME as GENAI

    folder = prune_stage.reference_folder(config, Layout(tmp_path))
    assert folder == (GENAI, (tmp_path / "served").resolve())
    timed = _reference_timings({"dense": 400.0, "reference": 320.0}, {"dense": 20.0, "reference": 14.0})
    monkeypatch.setattr(GENAI, "time", lambda folders, w: timed(folders, w.prompt, w.new_tokens, w.rounds))
    folders = {"dense": (GENAI, tmp_path / "dense"), "reference": folder}
    aim = prune_stage.aim_at_decoder_reference(config, benchmark, folders, np.zeros((1, 16), dtype=np.int64))
    assert aim["reference_of_dense"] == pytest.approx(0.7 if metric == "decode" else 0.8, rel=1e-12)
    assert aim["planned_ratio_of_dense"] == pytest.approx(planned, rel=1e-12)
    assert ("note" in aim) is held


def test_a_reference_that_is_not_an_onnxruntime_genai_model_is_refused(corpus_params, tmp_path):
    from pruneops.core.errors import ConfigError
    from pruneops.core.io import Layout
    from pruneops.task.causal_lm.prune import reference_folder

    (tmp_path / "served").mkdir()
    (tmp_path / "served" / "model.onnx").write_bytes(b"")  # no genai_config.json beside it
    target = {"kind": "latency_ratio", "value": 1.0, "reference": "served/model.onnx"}
    corpus_params["prune"] = {**corpus_params["prune"], "target": target}
    with pytest.raises(ConfigError, match=r"served/model.onnx is not the model.onnx of an onnxruntime-genai"):
        reference_folder(load_configs(corpus_params)["prune"], Layout(tmp_path))


def test_dvc_yaml_of_a_decoder_project_depends_on_the_whole_reference_folder(corpus_params, tmp_path):
    from pruneops.pipeline.dvcfile import user_files
    from pruneops.pipeline.stages import get_stage

    (tmp_path / "served").mkdir()
    target = {"kind": "latency_ratio", "value": 1.0, "reference": "served/model.onnx"}
    corpus_params["prune"] = {**corpus_params["prune"], "target": target}
    assert "served" in user_files(get_stage("prune"), load_configs(corpus_params), tmp_path)


def _injected_timings(ttft: dict[str, float], tpot: dict[str, float]):
    from pruneops.runtimes.genai.generation import GenerationTiming

    def timed(folders, vocab, batch, benchmark, seed=0):
        form = {p: p.removeprefix("dense ") for p in folders}  # dense in each precision times as its candidate
        return {
            p: GenerationTiming(ttft[form[p]], tpot[form[p]], (tpot[form[p]],), benchmark.prompt_length, 8, batch)
            for p in folders
        }

    return timed


@pytest.mark.slow(reason="the latency table and the gate export and time five shapes, a plan and a reference")
def test_prefill_targets_in_ms_and_of_a_reference_are_planned_gated_and_quantized_on_ttft(tmp_path, monkeypatch):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    import json

    from pruneops.core.io import Layout
    from pruneops.models.decoders import load_causal_lm
    from pruneops.pipeline.stages import get_stage
    from pruneops.planning.decode_cost import DecodeCostModel, DecoderShape
    from pruneops.task.causal_lm import quantize as quantize_stage
    from tests.decoder_helpers import save_small_llama

    save_small_llama(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n\n".join(speeches(120)))
    params = decoder_params(
        tmp_path / "model",
        tmp_path / "corpus.txt",
        prune={"target": {"kind": "latency_ratio", "value": 0.8, "metric": "prefill"}},
        finetune={"max_tokens": 512, "batch_size": 2, "lora_rank": 2},
        benchmark={"prompt_length": 128, "rounds": 3},
    )
    configs, layout = load_configs(params), Layout(tmp_path)
    for stage in ("validate", "train", "sensitivity", "latency"):
        get_stage(stage).run(configs, layout)
    cost = json.loads((tmp_path / "artifacts/latency/decode_cost.json").read_text())
    # The same target as an SLO in milliseconds: 0.8 of the dense time to first token just measured.
    params["prune"]["target"] = {"kind": "latency_ms", "value": 0.8 * cost["dense_ttft_ms"], "metric": "prefill"}
    configs = load_configs(params)
    for stage in ("prune", "finetune"):
        get_stage(stage).run(configs, layout)
    assert cost["dense_ttft_ms"] > cost["dense_tpot_ms"] > 0  # a 128-token prefill costs more than one step
    assert all(row["ttft_ms"] > 0 and row["predicted_ttft_ms"] > 0 for row in cost["table"])
    prune = json.loads((tmp_path / "metrics/prune.json").read_text())
    plan = json.loads((tmp_path / "artifacts/prune/plan.json").read_text())
    prefill = DecodeCostModel(**cost["prefill_cost"])
    assert prune["metric"] == "prefill"
    finetune = json.loads((tmp_path / "metrics/finetune.json").read_text())
    model = load_causal_lm(tmp_path / "artifacts/finetune/model")[0]  # merged: it reloads as a plain model
    layers = sum(p.numel() for layer in model.model.layers for p in layer.parameters() if p.dim() == 2)
    assert finetune["lora_rank"] == 2 and finetune["tokens"] >= 512
    assert 0 < finetune["trained_parameters"] < 0.5 * layers  # rank-2 adapters of small projections
    assert prune["target_ms"] == pytest.approx(0.8 * cost["dense_ttft_ms"])
    assert prune["predicted_ms"] == pytest.approx(prefill.predict(DecoderShape(**plan["shape"])))
    assert prune["predicted_ms"] <= prune["target_ms"] + 1e-9
    # The gate timed the first token: dense's is a 128-token prefill, tens of decode steps long.
    assert prune["dense_ms"] > 5 * cost["dense_tpot_ms"]

    # INT8 decodes faster and prefills slower (injected; within quantize.other_metric_tolerance's 10 % of dense
    # fp32's first token): a prefill target keeps fp32, a decode target INT8.
    timed = _injected_timings({"fp32": 40.0, "int8": 42.0}, {"fp32": 4.0, "int8": 2.0})
    monkeypatch.setattr(quantize_stage, "_timed", timed)
    for metric, expected in (("prefill", "fp32"), ("decode", "int8")):
        report = quantize_stage.quantize_decoder(configs["quantize"], configs["benchmark"], metric, layout)
        assert (report.metric, report.precision) == (metric, expected)
        assert (report.ttft_b1_ms, report.tpot_b1_ms) == ((40.0, 4.0) if expected == "fp32" else (42.0, 2.0))

    # As fast as a reference (dense itself, exported as a served model is): planned at value x its ratio.
    from pruneops.runtimes.genai.export import export_model as export_genai

    served = export_genai(*load_causal_lm(tmp_path / "artifacts/train/model"), tmp_path / "served", ["fp32"], 1)
    target = {"kind": "latency_ratio", "value": 0.8, "metric": "prefill", "reference": "served/fp32/model.onnx"}
    params["prune"]["target"] = target
    get_stage("prune").run(load_configs(params), layout)
    aim = json.loads((tmp_path / "artifacts/prune/plan.json").read_text())["reference"]
    prune = json.loads((tmp_path / "metrics/prune.json").read_text())
    assert aim["folder"] == str(served["fp32"].resolve()) and aim["metric"] == "prefill"
    assert aim["reference_of_dense"] == pytest.approx(aim["reference_ms"] / aim["dense_ms"], rel=1e-12)
    assert prune["reference_of_dense"] == aim["reference_of_dense"]
    planned = min(0.8 * aim["reference_of_dense"], 1.0)  # the gate: min_speedup null, at most dense's time
    assert aim["planned_ratio_of_dense"] == pytest.approx(planned, rel=1e-12)
    assert prune["target_ms"] == pytest.approx(planned * cost["dense_ttft_ms"], rel=1e-9)


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="the refusal of a missing CUDA device")
def test_finetune_on_a_cuda_device_torch_does_not_see_stops_in_one_line_before_loading(corpus_params, tmp_path, capsys):
    save_tiny("llama", tmp_path / "model")
    corpus_params["finetune"] = {**corpus_params["finetune"], "max_tokens": 1024, "device": "cuda"}
    write_params(tmp_path, corpus_params)
    project = ["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml")]
    assert main([*project, "validate"]) == 0
    capsys.readouterr()
    assert main([*project, "finetune"]) == 2  # before train and prune have run
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "recovery device 'cuda'" in err[0] and "use cpu" in err[0], err
    assert not (tmp_path / "artifacts" / "finetune").exists()


@pytest.mark.parametrize(
    ("family", "reason"),
    [
        ("mixtral", "routes tokens to experts"),  # decoder pruning cannot cut it
        ("olmo", "generates other tokens than transformers"),  # the builder builds it, wrongly
        ("cohere", "not currently supported"),  # the builder refuses it
    ],
)
def test_train_refuses_a_family_it_cannot_cut_or_serve_in_one_line(family, reason, corpus_params, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.decoder_helpers import VOCAB, family_decoder, tiny_tokenizer

    if family == "mixtral":
        config = AutoConfig.for_model(family, vocab_size=VOCAB, hidden_size=64, intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                                      num_local_experts=2, pad_token_id=2, bos_token_id=1, eos_token_id=1)  # fmt: skip
        model = AutoModelForCausalLM.from_config(config)
    else:
        model = family_decoder(family)
    model.save_pretrained(tmp_path / "model")
    tiny_tokenizer().save_pretrained(tmp_path / "model")
    write_params(tmp_path, corpus_params)
    project = ["--root", str(tmp_path), "--params", str(tmp_path / "params.yaml")]
    assert main([*project, "validate"]) == 0
    capsys.readouterr()
    assert main([*project, "train"]) == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]  # no bars
    assert len(err) == 1 and reason in err[0] and family in err[0], err
    assert not (tmp_path / "artifacts" / "train").exists()
