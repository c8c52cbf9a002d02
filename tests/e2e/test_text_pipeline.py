"""A pretrained text classifier through every stage by params alone: a CSV of sentences and a
local HuggingFace folder (a tiny BERT saved with `save_pretrained` beside its tokenizer.json)."""

from __future__ import annotations

import json

import numpy as np
import pytest

from pruneops.core.io import Layout
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.pipeline.stages import STAGE_NAMES as STAGES
from pruneops.pruning.heads import head_sites
from tests.conftest import tiny_params
from tests.pipeline.test_pipeline_dvc import repro_new_project
from tests.text_helpers import make_reviews, tiny_pretrained

pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
pytest.importorskip("tokenizers", reason="tokenizers (the `hf` extra) is not installed")


@pytest.mark.e2e
@pytest.mark.slow(reason="dvc repro of every stage on the real MiniLM and reviews")
def test_dvc_repro_runs_every_stage_from_a_text_csv_and_a_pretrained_folder(tmp_path):
    make_reviews(400).to_csv(tmp_path / "reviews.csv", index=False)
    tiny_pretrained(tmp_path / "pretrained")
    params = tiny_params(
        validate={"dataset": "text", "path": "reviews.csv", "label_column": "category", "tokenizer": "pretrained"},
        train={
            "model": "hf",
            "pretrained": "pretrained",
            "model_kwargs": {},
            "epochs": 4,
            "batch_size": 16,
            "lr": 1e-3,
        },
        sensitivity={"ratios": [0.25, 0.5]},
        prune={
            "target": {"kind": "ratio", "value": 0.5},
            "gate": {"min_speedup": None},
            "use_sensitivity": False,
            "steps": 1,
            "epochs_per_step": 1,
            "trim_vocabulary": True,
        },
        finetune={"epochs": 2},
    )
    out = repro_new_project(tmp_path, params)
    assert [s for s in STAGES if f"Running stage '{s}'" in out] == list(STAGES)
    lock = (tmp_path / "dvc.lock").read_text()
    assert "reviews.csv" in lock and "path: pretrained" in lock  # the user's files are DVC dependencies

    train = json.loads((tmp_path / "metrics/train.json").read_text())
    # The first word gives the label; chance is 50% on 80 test texts (sd 5.6 points).
    assert train["test_accuracy"] >= 0.8
    pruned = load_checkpoint(tmp_path / "artifacts/finetune/model.safetensors").model
    heads = [s.num_heads for s in head_sites(pruned).values()]
    assert len(heads) == 2 and sum(heads) < 8  # heads were removed, not only FFN neurons
    vocabulary = json.loads((tmp_path / "metrics/prune.json").read_text())["vocabulary"]
    # The word-level vocabulary: 4 specials and 18 words, all of which the 320 training texts use.
    assert vocabulary["rows_after"] == vocabulary["rows_before"] == 22
    assert pruned.token_map is not None  # the map travels with the checkpoint into export
    bench = json.loads((tmp_path / "metrics/benchmark.json").read_text())
    assert bench["mac_reduction"] > 1.2

    import onnxruntime as ort

    session = ort.InferenceSession(str(tmp_path / "artifacts/export/pruned_deployed.onnx"))
    assert [(i.name, i.type) for i in session.get_inputs()] == [
        ("input_ids", "tensor(int64)"),
        ("attention_mask", "tensor(int64)"),
    ]
    _, _, _, test = load_prepared(Layout(tmp_path).stage_dir("validate"))
    logits = session.run(None, test.x)[0]
    assert logits.shape == (len(test), 2) and np.isfinite(logits).all()
    finetune = json.loads((tmp_path / "metrics/finetune.json").read_text())
    assert float((logits.argmax(1) == test.y).mean()) == pytest.approx(finetune["test_accuracy"], abs=0.05)
