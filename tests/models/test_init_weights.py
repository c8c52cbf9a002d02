"""`train.init_weights`: the user's weights in, adopted as they are (`epochs: 0`) or fine-tuned."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from pruneops.config import TrainConfig
from pruneops.core.errors import CheckpointError, ConfigError
from pruneops.core.io import Layout
from pruneops.data import load_prepared
from pruneops.models import ModelSpec, create_model
from pruneops.models.checkpoint import load_checkpoint
from pruneops.models.init_weights import load_init_weights_, read_state_dict
from pruneops.task.classification.train import train_baseline
from pruneops.task.classification.validate import ValidateConfig, validate_dataset
from pruneops.training.fit import FitSettings, evaluate, fit_

SPEC = {"model": "cnn", "model_kwargs": {"widths": [8, 16]}}


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    root = tmp_path_factory.mktemp("digits")
    validate_dataset(ValidateConfig(), Layout(root))
    return root


def _trained_weights(digits, path, classes=10, epochs=3):
    """A model trained briefly on digits, saved as a plain state dict (as a user would)."""
    meta, train, val, _ = load_prepared(Layout(digits).stage_dir("validate"))
    torch.manual_seed(0)
    model = create_model(ModelSpec("cnn", meta.input_shape, classes, SPEC["model_kwargs"]))
    if classes == 10:
        fit_(model, train, val, FitSettings(epochs=epochs, lr=3e-3))
    state = model.state_dict()
    if path.suffix == ".safetensors":
        save_file({k: v.contiguous() for k, v in state.items()}, str(path))
    else:
        torch.save({"state_dict": state}, path)
    return model.eval()


@pytest.mark.parametrize("suffix", [".safetensors", ".pth"])
def test_epochs_0_adopts_the_weights_as_they_are(digits, tmp_path, suffix):
    source = _trained_weights(digits, tmp_path / f"w{suffix}")
    config = TrainConfig(**SPEC, epochs=0, init_weights=str(tmp_path / f"w{suffix}"))
    report = train_baseline(config, Layout(digits))
    baseline = load_checkpoint(report.checkpoint).model
    _, _, val, test = load_prepared(Layout(digits).stage_dir("validate"))
    x = torch.from_numpy(test.x)
    with torch.no_grad():
        assert torch.equal(baseline(x), source(x))  # the same logits: nothing trained, nothing lost
    assert report.epochs_run == 0 and not report.reset_classifier
    assert report.val_accuracy == evaluate(source, val)[0] > 0.5  # recorded, and a trained model's


def test_a_head_for_another_class_count_is_re_initialised_and_the_rest_loaded(digits, tmp_path):
    source = _trained_weights(digits, tmp_path / "w.pth", classes=1000)
    model = create_model(ModelSpec("cnn", [1, 8, 8], 10, SPEC["model_kwargs"]))
    adopted = load_init_weights_(model, tmp_path / "w.pth", strict=True, reset_classifier=None)
    assert adopted.reset_classifier and not adopted.missing and not adopted.unexpected
    ours, theirs = model.state_dict(), source.state_dict()
    assert all(torch.equal(ours[k], theirs[k]) for k in ours if not k.startswith("classifier"))
    assert ours["classifier.weight"].shape == (10, 16)
    with pytest.raises(CheckpointError, match="classifier shapes differ"):
        load_init_weights_(model, tmp_path / "w.pth", strict=True, reset_classifier=False)


def test_files_that_do_not_fit_are_refused_with_what_differs(digits, tmp_path):
    _trained_weights(digits, tmp_path / "w.pth", epochs=1)
    other = create_model(ModelSpec("cnn", [1, 8, 8], 10, {"widths": [8, 24]}))
    with pytest.raises(CheckpointError, match="do not fit the architecture"):
        load_init_weights_(other, tmp_path / "w.pth", strict=True, reset_classifier=None)
    state = read_state_dict(tmp_path / "w.pth")
    state["extra.weight"] = torch.zeros(2)
    torch.save(state, tmp_path / "extra.pth")
    model = create_model(ModelSpec("cnn", [1, 8, 8], 10, SPEC["model_kwargs"]))
    with pytest.raises(CheckpointError, match="1 unexpected"):
        load_init_weights_(model, tmp_path / "extra.pth", strict=True, reset_classifier=None)
    adopted = load_init_weights_(model, tmp_path / "extra.pth", strict=False, reset_classifier=None)
    assert adopted.unexpected == ["extra.weight"] and adopted.warnings


class _Payload:
    def __reduce__(self):
        return (print, ("pickled code ran",))


def test_pickled_code_and_garbage_are_refused(tmp_path):
    (tmp_path / "code.pth").write_bytes(pickle.dumps({"w": _Payload()}))
    torch.save({"w": _Payload()}, tmp_path / "code2.pth")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 40)
    for name in ("code.pth", "code2.pth", "junk.safetensors"):
        with pytest.raises(CheckpointError):
            read_state_dict(tmp_path / name)
    with pytest.raises(ConfigError, match="not found"):
        read_state_dict(tmp_path / "absent.pth")


def test_epochs_0_needs_weights_and_defaults_follow_them():
    with pytest.raises(ValueError, match="adopts train.init_weights"):
        TrainConfig(epochs=0)
    scratch, tuned = TrainConfig(), TrainConfig(init_weights="w.pth")
    assert (scratch.resolved_lr, scratch.resolved_warmup_epochs) == (3e-3, 0.0)
    assert (tuned.resolved_lr, tuned.resolved_warmup_epochs) == (1e-3, 1.0)
    assert TrainConfig(init_weights="w.pth", lr=0.01).resolved_lr == 0.01


def test_a_frozen_backbone_trains_only_the_head_then_everything(digits):
    meta, train, val, _ = load_prepared(Layout(digits).stage_dir("validate"))
    torch.manual_seed(0)
    model = create_model(ModelSpec("cnn", meta.input_shape, 10, SPEC["model_kwargs"]))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    fit = fit_(model, train, val, FitSettings(epochs=1, lr=3e-3, freeze_epochs=1), frozen_except=model.classifier)
    after = model.state_dict()
    moved = {
        k for k in before if "running" not in k and "num_batches" not in k and not torch.equal(before[k], after[k])
    }
    assert moved == {"classifier.weight", "classifier.bias"}, moved
    assert fit.best_val_accuracy > 0.1  # a head over random features still learns something
    graded: list[int] = []  # parameters with a gradient, per step

    def count(m):
        graded.append(sum(p.grad is not None for p in m.parameters()))

    settings = FitSettings(epochs=2, lr=3e-3, freeze_epochs=1, patience=5)
    fit_(model, train, val, settings, frozen_except=model.classifier, after_backward=count)
    steps = len(graded) // 2
    assert set(graded[:steps]) == {2} and set(graded[steps:]) == {len(list(model.parameters()))}
    assert all(p.requires_grad for p in model.parameters())


def test_warm_up_raises_the_lr_linearly_then_decays():
    from pruneops.training.fit import _schedule

    param = torch.nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([param], lr=1.0)
    sched = _schedule(opt, FitSettings(epochs=4, warmup_epochs=1.0), steps_per_epoch=10)
    lrs = []
    for _ in range(40):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert np.allclose(lrs[:10], np.arange(1, 11) / 10)
    assert lrs[10] == pytest.approx(1.0) and all(a >= b for a, b in zip(lrs[10:], lrs[11:], strict=False))
    assert lrs[-1] < 0.01
