"""The decoder path of the pipeline: params validated across sections, and `dvc repro` by params alone."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pruneops.cli import main  # noqa: E402
from pruneops.stages import STAGE_NAMES, load_configs  # noqa: E402
from tests.conftest import write_params  # noqa: E402
from tests.llm.decoder_helpers import decoder_params, save_small_llama, save_tiny, speeches  # noqa: E402


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
    ],
)
def test_a_decoder_params_mistake_is_one_line(corpus_params, tmp_path, capsys, section, change, named):
    corpus_params[section] = {**corpus_params[section], **change}
    assert named in _one_line_error(corpus_params, tmp_path, capsys)


def test_a_corpus_that_fails_its_expectations_writes_nothing(tmp_path):
    from pruneops.errors import DataValidationError
    from pruneops.io import Layout
    from pruneops.stages import get_stage

    save_tiny("llama", tmp_path / "model")
    documents = speeches(40)
    (tmp_path / "corpus.txt").write_text("\n\n".join(documents + ["the"] * 3))  # three one-word documents
    params = decoder_params(tmp_path / "model", tmp_path / "corpus.txt")
    params["validate"].update(min_text_chars=20, drop_duplicates=False, max_duplicate_fraction=0.5)
    with pytest.raises(DataValidationError, match="n_chars"):
        get_stage("validate").run(load_configs(params), Layout(tmp_path))
    assert not (tmp_path / "artifacts" / "validate").exists()


# ~4 min: nine stage processes, about fifteen onnxruntime-genai exports of a 4M-parameter Llama, each
# timed for real (no injection: the run is DVC's), then a no-op repro.
@pytest.mark.e2e
@pytest.mark.slow(reason="dvc repro of the decoder path: fifteen genai exports and their timings")
def test_dvc_repro_of_a_decoder_by_params_alone(tmp_path):
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from tests.test_pipeline_dvc import _sh, repro_new_project

    save_small_llama(tmp_path / "model")
    (tmp_path / "corpus.txt").write_text("\n\n".join(speeches(120)))
    params = decoder_params(tmp_path / "model", tmp_path / "corpus.txt")
    out = repro_new_project(tmp_path, params)
    assert [s for s in STAGE_NAMES if f"Running stage '{s}'" in out] == list(STAGE_NAMES)
    metrics = {s: json.loads((tmp_path / "metrics" / f"{s}.json").read_text()) for s in STAGE_NAMES}
    assert metrics["validate"]["expectations_failed"] == 0 and metrics["validate"]["blocks"]["test"] >= 1
    assert sorted(metrics["sensitivity"]["layer_order"]) == [0, 1, 2, 3]
    prune = metrics["prune"]
    assert prune["predicted_ms"] <= prune["target_ms"] + 1e-9 and prune["measured_speedup"] > 1.0
    assert metrics["finetune"]["tokens"] == 256
    assert metrics["export"]["greedy_tokens_equal"] == metrics["export"]["greedy_tokens_checked"] == 16
    bench = metrics["benchmark"]
    low, high = bench["test_perplexity_ratio_ci"]
    assert low <= bench["test_perplexity_ratio"] <= high and bench["speedup_b1"] > 1.0
    served = tmp_path / "artifacts" / "export" / "model"
    assert (served / "genai_config.json").is_file() and (tmp_path / "plots" / "benchmark" / "frontier.png").is_file()
    again = _sh(tmp_path, str(Path(sys.executable).parent / "dvc"), "repro").stdout
    assert "Running stage" not in again
