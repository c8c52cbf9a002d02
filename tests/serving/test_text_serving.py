"""Serving a text model: `/predict` takes texts and tokenises them with the model's tokenizer.json,
answers with label names, measures drift on token length and unknown-token rate, and keeps
labelled texts (by name) as a CSV that `validate.dataset: text` reads back."""

import re

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed")
pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from pruneops.config import ValidateConfig  # noqa: E402
from pruneops.core.inputs import text_inputs  # noqa: E402
from pruneops.core.integrity import write_checksum
from pruneops.core.io import Layout, read_json  # noqa: E402
from pruneops.data import load_prepared  # noqa: E402
from pruneops.data.text import load_tokenizer, read_text_table, tokenize  # noqa: E402
from pruneops.modelstore.store import ModelRegistry  # noqa: E402
from pruneops.runtimes.onnxruntime.files import export_onnx_file  # noqa: E402
from pruneops.serving.app import ServingConfig, create_app  # noqa: E402
from pruneops.task.classification.validate import validate_dataset  # noqa: E402
from tests.text_helpers import make_reviews, tiny_pretrained  # noqa: E402


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    import torch
    from transformers import BertForSequenceClassification

    from pruneops.models.hf import SequenceLogits

    root = tmp_path_factory.mktemp("text-serving")
    folder = tiny_pretrained(root / "classifier", num_labels=2)
    reviews = make_reviews(300)
    reviews.to_csv(root / "reviews.csv", index=False)
    layout = Layout(root)
    config = ValidateConfig(
        dataset="text", path=str(root / "reviews.csv"), label_column="category", tokenizer=str(folder)
    )
    validate_dataset(config, layout)
    meta = read_json(layout.stage_dir("validate") / "meta.json")
    model = SequenceLogits(BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True)).eval()
    export = layout.stage_dir("export")
    export.mkdir(parents=True)
    export_onnx_file(model, text_inputs(), export / "pruned_deployed.onnx", 18, sizes={"seq": 16})
    write_checksum(export / "pruned_deployed.onnx")  # as the export stage records it
    registry = ModelRegistry(root / "models")
    registry.promote(registry.register_pipeline_model(root, {"sparsity": 0.0}).version)
    serving = ServingConfig(
        production=root / "models/production",
        reference_stats=None,
        drift_window=200,
        drift_min_samples=20,
        reload_interval_s=3600,
        feedback_path=root / "feedback.npz",
        feedback_flush_every=5,
    )
    return root, folder, model, meta, serving, reviews, torch


def test_texts_are_tokenised_as_validate_did_and_answered_with_label_names(served):
    root, folder, model, meta, serving, reviews, torch = served
    texts = reviews["text"].tolist()[:12]
    with TestClient(create_app(serving)) as client:
        r = client.post("/predict", json={"texts": texts})
        assert r.status_code == 200, r.text
        body = r.json()
    assert set(body["class_names"]) <= {"fresh", "rotten"}
    assert body["class_names"] == [["fresh", "rotten"][c] for c in body["classes"]]
    # The same ids validate wrote for training, so the served probabilities are the model's own.
    feed = tokenize(load_tokenizer(folder), texts, meta["text"]["max_length"])
    with torch.no_grad():
        expected = torch.softmax(
            model(torch.from_numpy(feed["input_ids"]), torch.from_numpy(feed["attention_mask"])), 1
        )
    np.testing.assert_allclose(np.array(body["probabilities"]), expected.numpy(), atol=1e-4)


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ({"inputs": [[1, 2, 3]]}, "this is a text model"),
        ({"images": ["aGk="]}, "this is a text model"),
        ({"texts": ["fine", "   "]}, "texts[1] is empty"),
        ({"texts": []}, "batch size must be 1.."),
    ],
)
def test_bad_text_requests_are_named(served, payload, message):
    serving = served[4]
    with TestClient(create_app(serving)) as client:
        r = client.post("/predict", json=payload)
        assert r.status_code == 422 and message in r.json()["error"]
        assert client.post("/predict", json={"texts": ["good film"]}).status_code == 200


def test_feedback_by_label_name_is_kept_as_text_csv_that_validate_reads(served):
    root, *_, serving, reviews, _ = served
    texts, labels = reviews["text"].tolist()[:10], reviews["category"].tolist()[:10]
    with TestClient(create_app(serving)) as client:
        body = client.post("/predict", json={"texts": texts}).json()
        for pid, label in zip(body["prediction_ids"], labels, strict=True):
            assert client.post("/feedback", json={"prediction_id": pid, "label": label}).status_code == 200
        bad = client.post("/feedback", json={"prediction_id": body["prediction_ids"][0], "label": "meh"})
        assert bad.status_code == 422 and "one of ['fresh', 'rotten']" in bad.json()["error"]
    saved = read_text_table(root / "feedback.csv", "text", "label")
    assert saved.texts == texts and [saved.label_names[i] for i in saved.labels] == labels


def test_drift_is_measured_on_token_length_and_unknown_tokens(served):
    root, *_, serving, reviews, _ = served
    rng = np.random.default_rng(1)
    like_training = reviews["text"].sample(60, random_state=1).tolist()
    # Long texts of words the vocabulary lacks: every one fills max_length, mostly with [UNK].
    unlike = [" ".join(f"qq{rng.integers(1000)}" for _ in range(40)) for _ in range(60)]

    def psi(texts: list[str]) -> dict[str, float]:
        with TestClient(create_app(serving)) as client:
            assert client.post("/predict", json={"texts": texts}).status_code == 200
            metrics = client.get("/metrics").text
        return {g: float(v) for g, v in re.findall(r'pruneops_drift_score\{group="(\w+)"\} ([\d.e+-]+)', metrics)}

    calm, shifted = psi(like_training), psi(unlike)
    assert {"token_length", "unknown_token_rate", "overall"} <= set(calm)
    # 60 texts over 20 bins: a sample like the reference scores about (bins - 1) / n = 0.3 by
    # chance; texts that all land in one bin the reference rarely uses score several times that.
    assert shifted["token_length"] > 3 * max(calm["token_length"], 0.1)
    assert shifted["unknown_token_rate"] > 3 * max(calm["unknown_token_rate"], 0.1)
    _, _, _, test = load_prepared(Layout(root).stage_dir("validate"))
    assert test.named
