"""The decoder path of the pipeline: params validated across sections, a failing corpus writes nothing,
its dvc.yaml plots. `dvc repro` of it and the loop after: tests/flows/test_decoder_reprune.py."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("transformers")

from pruneops.cli import main  # noqa: E402
from pruneops.stages import load_configs  # noqa: E402
from tests.conftest import write_params  # noqa: E402
from tests.llm.decoder_helpers import decoder_params, save_tiny, speeches  # noqa: E402


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


def test_dvc_yaml_of_a_decoder_project_plots_the_rows_its_stages_write(corpus_params, tmp_path):
    from pruneops.dvcfile import render

    write_params(tmp_path, corpus_params)
    stages = render(tmp_path)["stages"]

    def axes(stage: str, file: str) -> tuple[str, str]:
        entry = next(p[f"plots/{stage}/{file}"] for p in stages[stage]["plots"] if f"plots/{stage}/{file}" in p)
        return entry["x"], entry["y"]

    assert axes("benchmark", "frontier.json") == ("latency_b1_ms", "test_perplexity")
    assert axes("finetune", "history.json") == ("tokens", "loss")
    assert axes("sensitivity", "curves.json") == ("layer", "perplexity_increase")
    assert axes("prune", "history.json") == ("step", "search_perplexity")
