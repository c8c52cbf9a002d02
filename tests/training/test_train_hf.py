"""`train.model: hf`: a pretrained HuggingFace folder fine-tuned (or adopted) by params alone.

The folder is a tiny BERT saved with `save_pretrained` beside a word-level tokenizer (no
downloads); the text is built so that its first word gives the label.
"""

import pytest
import torch

from pruneops.config import TrainConfig, ValidateConfig
from pruneops.core.inputs import as_tensors, trim_padding
from pruneops.core.io import Layout
from pruneops.data import load_prepared
from pruneops.models.checkpoint import load_checkpoint
from pruneops.models.forward import predict_logits
from pruneops.task.classification.train import train_baseline
from pruneops.task.classification.validate import validate_dataset
from tests.text_helpers import make_reviews, tiny_pretrained

pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")


def _validated(tmp_path, folder, n=400):
    make_reviews(n).to_csv(tmp_path / "reviews.csv", index=False)
    layout = Layout(tmp_path / "run")
    config = ValidateConfig(
        dataset="text", path=str(tmp_path / "reviews.csv"), label_column="category", tokenizer=str(folder)
    )
    validate_dataset(config, layout)
    return layout


def test_pretrained_folder_fine_tuned_to_the_labels_and_reloaded_identically(tmp_path):
    folder = tiny_pretrained(tmp_path / "pretrained")
    layout = _validated(tmp_path, folder)
    config = TrainConfig(model="hf", pretrained=str(folder), epochs=4, batch_size=16, lr=1e-3, threads=1)
    report = train_baseline(config, layout)
    # The first word decides the label: a 2-layer encoder learns it; chance is 50% on 80 test texts,
    # so 80% is more than 5 binomial standard deviations above it.
    assert report.test_accuracy >= 0.8, report
    assert report.reset_classifier and "classifier.weight" in report.warnings[0]
    assert report.params > 10_000 and report.macs > 0
    meta, _, _, test = load_prepared(layout.stage_dir("validate"))
    ckpt = load_checkpoint(report.checkpoint)  # rebuilt from the config kept in the checkpoint
    assert ckpt.spec.inputs == meta.inputs and "hf_config" in ckpt.spec.kwargs
    logits = predict_logits(ckpt.model, test.x)
    acc = float((logits.argmax(1).numpy() == test.y).mean())
    assert acc == pytest.approx(report.test_accuracy, abs=1e-9)

    # Static INT8 of the fine-tuned model: only its matrix products are quantized. Calibrating the
    # attention-mask arithmetic too gave NaN zero points and a model at chance (50%) here.
    from pruneops.config import QuantizeConfig
    from pruneops.runtimes.onnxruntime.files import export_onnx_file, make_session, ort_accuracy
    from pruneops.runtimes.onnxruntime.quantizers import quantize_static_qdq

    export_onnx_file(ckpt.model, meta.input_shape, tmp_path / "fp32.onnx", 18)
    train = load_prepared(layout.stage_dir("validate"))[1]
    calib = {k: v[:128] for k, v in train.x.items()}
    quantize_static_qdq(tmp_path / "fp32.onnx", tmp_path / "int8.onnx", calib, QuantizeConfig())
    int8 = ort_accuracy(make_session(tmp_path / "int8.onnx"), test.x, test.y)
    assert int8 >= acc - 0.1, (int8, acc)  # 8 of 80 texts: well above the noise, far from chance


def test_epochs_0_adopts_a_fine_tuned_classifier_as_is(tmp_path):
    from transformers import BertForSequenceClassification

    folder = tiny_pretrained(tmp_path / "classifier", num_labels=2, seed=3)
    layout = _validated(tmp_path, folder)
    report = train_baseline(TrainConfig(model="hf", pretrained=str(folder), epochs=0, threads=1), layout)
    assert not report.reset_classifier and report.warnings == () and report.epochs_run == 0
    _, _, _, test = load_prepared(layout.stage_dir("validate"))
    reference = BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    with torch.no_grad():
        expected = reference(**as_tensors(test.x)).logits
    got = predict_logits(load_checkpoint(report.checkpoint).model, test.x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-4)


def test_trimming_padding_leaves_the_logits_unchanged(tmp_path):
    folder = tiny_pretrained(tmp_path / "classifier", num_labels=2)
    from transformers import BertForSequenceClassification

    model = BertForSequenceClassification.from_pretrained(str(folder), local_files_only=True).eval()
    ids = torch.randint(4, 20, (4, 32))
    mask = torch.zeros(4, 32, dtype=torch.long)
    for i, n in enumerate((5, 9, 3, 12)):
        mask[i, :n] = 1
    full = {"input_ids": ids * mask, "attention_mask": mask}
    short = trim_padding(full)
    assert short["input_ids"].shape == (4, 12)
    with torch.no_grad():
        expected = model(**full).logits
    torch.testing.assert_close(model(**short).logits.detach(), expected, atol=1e-5, rtol=1e-4)
    # predict_logits runs the texts shortest first, two by two, and returns them in their order.
    batched = predict_logits(_Logits(model), {k: v.numpy() for k, v in full.items()}, batch_size=2)
    torch.testing.assert_close(batched, expected, atol=1e-5, rtol=1e-4)


class _Logits(torch.nn.Module):
    """A HuggingFace classifier returning plain logits, as the pipeline's wrapper does."""

    def __init__(self, model):
        super().__init__()
        self.model = model

    def forward(self, **inputs):
        return self.model(**inputs).logits


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"model": "hf", "epochs": 1}, "pretrained: model 'hf' needs the local folder"),
        ({"model": "cnn", "pretrained": "x"}, "pretrained: only for model 'hf'"),
    ],
)
def test_hf_config_errors(kwargs, message):
    with pytest.raises(ValueError, match=message):
        TrainConfig(**kwargs)


def test_a_folder_without_a_config_is_named(tmp_path):
    from pruneops.core.errors import ConfigError
    from pruneops.models.hf import pretrained_config

    (tmp_path / "empty").mkdir()
    with pytest.raises(ConfigError, match="is not a pretrained model folder"):
        pretrained_config(tmp_path / "empty")
