import copy

import torch

from pruneops.core.io import Layout
from pruneops.data import load_prepared
from pruneops.models import ModelSpec, create_model
from pruneops.task.classification.validate import ValidateConfig, validate_dataset
from pruneops.training.distillation import Distillation
from pruneops.training.fit import FitSettings, evaluate, fit_


def _digits(tmp_path):
    return load_prepared(validate_dataset(ValidateConfig(), Layout(tmp_path)).data_dir)


def test_fit_learns_digits_and_is_seeded(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    results = []
    for _ in range(2):
        torch.manual_seed(0)
        model = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [64]}))
        fit = fit_(model, train, val, FitSettings(epochs=4, lr=3e-3, seed=1))
        results.append((fit.best_val_accuracy, evaluate(model, val)[0]))
    assert results[0] == results[1]
    assert results[0][0] > 0.85
    assert results[0][1] == results[0][0]  # the best epoch's weights are the ones kept


def _stale_runs(history: list[dict]) -> list[int]:
    """Epochs without a better (accuracy, -loss) than the best so far, at each epoch, as `fit_` counts them."""
    best, stale, runs = None, 0, []
    for h in history:
        key = (h["val_accuracy"], -h["val_loss"])
        best, stale = (key, 0) if best is None or key > best else (best, stale + 1)
        runs.append(stale)
    return runs


def test_early_stopping_waits_for_the_lr_to_halve_then_stops(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    model = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [8]}))
    settings = FitSettings(epochs=20, lr=0.5, patience=2)  # LR 0.5 diverges: accuracy stalls early
    fit = fit_(model, train, val, settings)
    assert settings.earliest_stop == 10  # the cosine is at half its peak halfway through
    stale = _stale_runs(fit.history)
    # Stale for `patience` epochs before the midpoint (the old rule stopped there), yet it went on,
    # and stopped at the first epoch from the midpoint on that had been stale that long.
    assert any(n >= settings.patience for n in stale[: int(settings.earliest_stop) - 1])
    stops = [e for e, n in enumerate(stale, 1) if n >= settings.patience and e >= settings.earliest_stop]
    assert len(fit.history) == stops[0] < 20
    assert FitSettings(epochs=20, warmup_epochs=2).earliest_stop == 11  # the decay starts after warm-up


def test_distillation_pulls_student_towards_teacher(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    teacher = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [128]}))
    fit_(teacher, train, val, FitSettings(epochs=5, lr=3e-3))
    student = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [32]}))
    untrained = copy.deepcopy(student)
    fit_(student, train, val, FitSettings(epochs=10, lr=3e-3), distillation=Distillation(teacher, 2.0, 1.0))
    xs = torch.from_numpy(val.x)
    with torch.no_grad():
        t = teacher(xs).argmax(1)
        agree_after = (student(xs).argmax(1) == t).float().mean()
        agree_before = (untrained(xs).argmax(1) == t).float().mean()
    assert agree_after > 0.85 > agree_before


def test_distillation_stops_once_the_student_matches_the_teacher(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    # An under-trained teacher (~80% here): what a baseline trained for few epochs gives.
    teacher = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [32]}))
    fit_(teacher, train, val, FitSettings(epochs=3, lr=3e-3))
    teacher_acc = evaluate(teacher, val)[0]
    student = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [32]}))
    start_acc = evaluate(student, val)[0]
    settings = FitSettings(epochs=6, lr=3e-3, patience=6)
    until = copy.deepcopy(student)
    fit = fit_(until, train, val, settings, distillation=Distillation(teacher, 2.0, 0.5, until_accuracy=teacher_acc))
    # Each epoch distilled exactly when it began below the teacher's validation accuracy: here
    # the first ones did, and the student went past the teacher and stopped.
    began = [start_acc] + [e["val_accuracy"] for e in fit.history[:-1]]
    assert [e["distilled"] for e in fit.history] == [acc < teacher_acc for acc in began]
    assert fit.history[0]["distilled"] and not fit.history[-1]["distilled"]
    # A teacher the student starts level with is never used: the fit is the one on labels alone.
    plain, level = copy.deepcopy(student), copy.deepcopy(student)
    plain_fit = fit_(plain, train, val, settings)
    fit = fit_(level, train, val, settings, distillation=Distillation(teacher, 2.0, 0.5, until_accuracy=start_acc))
    assert not any(e["distilled"] for e in fit.history + plain_fit.history)
    # A teacher given no weight teaches nothing either, and the history says so.
    fit = fit_(copy.deepcopy(student), train, val, settings, distillation=Distillation(teacher, 2.0, 0.0))
    assert not any(e["distilled"] for e in fit.history)
    for a, b in zip(plain.parameters(), level.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=0, rtol=0)


def test_the_teacher_runs_once_per_fit_and_its_cached_logits_train_alike(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    teacher = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [32]}))
    student = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [16]}))
    calls = []
    teacher.register_forward_hook(lambda *_: calls.append(1))
    settings = FitSettings(epochs=3, lr=3e-3, batch_size=32)
    cached = copy.deepcopy(student)
    fit_(cached, train, val, settings, distillation=Distillation(teacher, 2.0, 0.5))
    # One pass over the training split in batches of 256, not one per batch of every epoch.
    assert len(calls) == -(-len(train.y) // 256)

    class PerBatch(Distillation):
        # The teacher run on every batch (what an augmented fit does), with the cache declined.
        def teacher_logits(self, idx, xb):
            with torch.no_grad():
                return self.teacher(xb)

    per_batch = copy.deepcopy(student)
    kd = PerBatch(teacher, 2.0, 0.5, logits=torch.empty(0))  # a cache is given: fit_ keeps it, unused
    fit_(per_batch, train, val, settings, distillation=kd)
    for a, b in zip(cached.parameters(), per_batch.parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


def test_recalibrate_batchnorm_sets_running_stats_to_the_data_statistics():
    from pruneops.training.fit import recalibrate_batchnorm_

    torch.manual_seed(0)
    conv = torch.nn.Conv2d(1, 4, 3, padding=1)
    bn = torch.nn.BatchNorm2d(4)
    model = torch.nn.Sequential(conv, bn, torch.nn.ReLU()).eval()
    bn.running_mean.fill_(5.0)  # stale statistics, as after a channel was cut away upstream
    bn.running_var.fill_(9.0)
    x = (torch.randn(320, 1, 8, 8) * 2 + 1).numpy()  # whole batches: the average of batch means is the mean
    assert recalibrate_batchnorm_(model, x, batch_size=64)
    with torch.no_grad():
        h = conv(torch.from_numpy(x))
    expected_mean = h.mean(dim=(0, 2, 3))
    # Cumulative average of per-batch statistics: the mean exactly, the (unbiased) variance closely.
    torch.testing.assert_close(bn.running_mean, expected_mean, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(bn.running_var, h.var(dim=(0, 2, 3)), atol=0.05, rtol=0.02)
    assert not model.training and bn.momentum == 0.1
    assert not recalibrate_batchnorm_(torch.nn.Linear(3, 2), x)


def test_hidden_distillation_pulls_each_pruned_layer_towards_its_original(tmp_path):
    import pytest

    from pruneops.core.errors import PruneOpsError
    from pruneops.core.inputs import head_tensors
    from pruneops.pruning.importance import IMPORTANCES
    from pruneops.pruning.units import UnitPruner
    from pruneops.training.distillation import BlockTaps, repeated_blocks

    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    teacher = create_model(ModelSpec("transformer", meta.input_shape, 10, {"dim": 32, "depth": 2, "ffn_dim": 64}))
    fit_(teacher, train, val, FitSettings(epochs=3, lr=3e-3))
    assert repeated_blocks(teacher, teacher) == ["layers.0", "layers.1"]
    pruned = copy.deepcopy(teacher)
    pruner = UnitPruner(pruned, head_tensors(train.x), IMPORTANCES.get("l2"))
    pruner.prune_to_({n: max(1, u.size // 4) for n, u in pruner.units().items() if "classifier" not in n})

    def block_error(student):
        taps = BlockTaps(student, teacher)
        with torch.no_grad():
            student.eval()(torch.from_numpy(val.x))
            teacher.eval()(torch.from_numpy(val.x))
        error = float(taps.mse())
        taps.close()
        return error

    errors = {}
    for weight in (0.0, 10.0):
        student = copy.deepcopy(pruned)
        kd = Distillation(teacher, 2.0, 0.5, hidden_weight=weight)
        fit_(student, train, val, FitSettings(epochs=2, lr=1e-3, seed=3), distillation=kd)
        errors[weight] = block_error(student)
        assert not student._forward_hooks and not any(m._forward_hooks for m in student.modules())  # hooks removed
    # Pruned, the layers are off by ~0.52 (mean squared, per element); two epochs on logits alone
    # leave ~0.37, with the layer outputs as a loss term ~0.24 (measured). Seeded alike, the two
    # runs differ only in that term: a fifth less is well clear of run-to-run noise.
    assert errors[10.0] < 0.8 * errors[0.0] < 0.8 * block_error(pruned), errors
    mlp = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [16]}))
    with pytest.raises(PruneOpsError, match="no repeated blocks"):
        BlockTaps(mlp, copy.deepcopy(mlp))


def test_convolutions_train_channels_last_and_come_back_contiguous(tmp_path):
    from safetensors.torch import save_file

    from pruneops.models.forward import channels_last_

    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    model = create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [8, 16], "blocks": 1}))
    convs = [p for p in model.parameters() if p.dim() == 4]
    seen = []
    with channels_last_(model) as converted:
        seen = [(p.is_contiguous(memory_format=torch.channels_last), p.is_contiguous()) for p in convs]
    # A 1-channel weight is both; the others are channels-last only.
    assert converted and all(last for last, _ in seen) and not all(standard for _, standard in seen)
    assert all(p.is_contiguous() for p in convs)

    fit = fit_(model, train, val, FitSettings(epochs=3, lr=3e-3))
    assert fit.best_val_accuracy > 0.5  # it learns (chance is 0.1 on 360 images, SE 0.016)
    assert all(p.is_contiguous() for p in model.parameters())
    save_file(model.state_dict(), str(tmp_path / "w.safetensors"))  # refuses non-contiguous tensors

    mlp = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [8]}))
    try:
        with channels_last_(model, mlp) as converted:
            raise RuntimeError("stop")
    except RuntimeError:
        pass
    assert all(p.is_contiguous() for p in model.parameters())
    with channels_last_(mlp) as converted:
        assert not converted


def test_a_strided_pointwise_conv_over_few_channels_trains_in_nchw_and_seeded_fits_agree(tmp_path):
    """torch 2.13's channels-last backward of a 1x1 stride-2 conv over 2-6 channels corrupts memory."""
    from pruneops.models.forward import channels_last_

    meta, train, val, _ = _digits(tmp_path)
    narrow = create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [4, 8]}))  # 4 -> 8 shortcut
    with channels_last_(narrow) as converted:
        assert not converted
    with channels_last_(create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [8, 16]}))) as converted:
        assert converted
    fits = [copy.deepcopy(narrow) for _ in range(2)]
    for model in fits:
        fit_(model, train, val, FitSettings(epochs=2, lr=3e-3, batch_size=32))
    # Seeded, one process, one kernel path: bit for bit (the corrupted kernel ended 0.07 apart).
    for a, b in zip(fits[0].parameters(), fits[1].parameters(), strict=True):
        assert torch.equal(a, b)


def _text_split(n: int, length: int, vocab: int, seed: int):
    import numpy as np

    from pruneops.data.splits import Split

    rng = np.random.default_rng(seed)
    ids = rng.integers(3, vocab, (n, length))
    mask = np.zeros((n, length), dtype=np.int64)
    for i, kept in enumerate(rng.integers(3, length + 1, n)):
        mask[i, :kept] = 1
    ids = np.where(mask == 1, ids, 0)
    return Split({"input_ids": ids, "attention_mask": mask}, (ids[:, 1] % 2).astype(np.int64))


def _tiny_encoder(family: str):
    import pytest

    transformers = pytest.importorskip("transformers", reason="transformers (the `hf` extra) is not installed")
    from pruneops.models.hf import SequenceLogits

    kwargs = {"vocab_size": 40, "max_position_embeddings": 32, "num_labels": 2}
    torch.manual_seed(0)
    if family == "distilbert":
        config = transformers.DistilBertConfig(dim=16, n_layers=3, n_heads=2, hidden_dim=24, **kwargs)
        model = transformers.DistilBertForSequenceClassification(config)
    else:
        config = transformers.BertConfig(
            hidden_size=16, num_hidden_layers=3, num_attention_heads=2, intermediate_size=24, **kwargs
        )
        model = transformers.BertForSequenceClassification(config)
    return SequenceLogits(model.eval())


def _layer_distillation_run(family: str, monkeypatch, budget: int | None):
    """Two epochs of layer-wise distillation into a perturbed copy; the teacher's forward calls counted."""
    import pruneops.training.distillation as training

    if budget is not None:
        monkeypatch.setattr(training, "TEACHER_CACHE_BYTES", budget)
    teacher = _tiny_encoder(family)
    student = copy.deepcopy(teacher)
    with torch.no_grad():
        for p in student.parameters():
            p.add_(0.05 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    calls = []
    teacher.register_forward_pre_hook(lambda *_: calls.append(1))
    train, val = _text_split(96, 16, 40, 0), _text_split(32, 16, 40, 1)
    kd = Distillation(teacher, 2.0, 0.5, hidden_weight=1.0)
    fit = fit_(student, train, val, FitSettings(epochs=2, batch_size=16, lr=1e-3, patience=3, seed=0), distillation=kd)
    return fit, student, len(calls), val


import pytest  # noqa: E402


@pytest.mark.parametrize("family", ["bert", "distilbert"])
def test_layer_distillation_runs_the_teacher_once_per_fit_to_the_same_effect(family, monkeypatch):
    """The teacher's block outputs, computed once at the padded length and cut to each batch's, train
    the student as the teacher run on every (trimmed) batch does; only the teacher's work changes."""
    cached = _layer_distillation_run(family, monkeypatch, None)
    per_batch = _layer_distillation_run(family, monkeypatch, 0)
    # Both: two one-sample runs that size the cache. Cached: then one pass over the 96 samples
    # (128 a batch). Over budget: 6 batches in each of 2 epochs.
    assert (cached[2], per_batch[2]) == (2 + 1, 2 + 2 * 6)
    losses = [[h["train_loss"] for h in fit.history] for fit, *_ in (cached, per_batch)]
    assert losses[0] == pytest.approx(losses[1], rel=1e-5)
    x = {k: torch.from_numpy(v) for k, v in cached[3].x.items()}
    with torch.no_grad():
        torch.testing.assert_close(cached[1](**x), per_batch[1](**x), rtol=1e-4, atol=1e-4)


def test_the_block_cache_finds_the_text_dim_and_keeps_to_its_budget(caplog):
    import logging

    from pruneops.training.distillation import cache_blocks, repeated_blocks

    teacher = _tiny_encoder("bert")
    split = _text_split(10, 12, 40, 0)
    logits, blocks = cache_blocks(teacher, split.x, batch_size=4)
    names = repeated_blocks(teacher, teacher)
    assert list(blocks.outputs) == names and len(names) == 3
    assert blocks.seq_dims == dict.fromkeys(names, 1)  # (batch, tokens, hidden)
    assert blocks.outputs[names[0]].shape == (10, 12, 16) and logits.shape == (10, 2)
    with caplog.at_level(logging.INFO, logger="pruneops.training.distillation"):
        assert cache_blocks(teacher, split.x, budget=10 * 12 * 16 * 3 * 4 - 1) is None
    assert "the teacher runs on every batch" in caplog.text
    # No repeated blocks: nothing to cache, and no pass over the data (`BlockTaps` then refuses).
    calls = []
    lone = torch.nn.Linear(4, 2)
    lone.register_forward_pre_hook(lambda *_: calls.append(1))
    assert cache_blocks(lone, torch.zeros(8, 4).numpy()) is None and not calls


def test_the_teacher_on_onnx_runtime_gives_its_logits_and_an_augmented_fit_trains_alike(tmp_path):
    from pruneops.training.fit import onnx_forward

    meta, train, val, _ = _digits(tmp_path)
    torch.manual_seed(0)
    teacher = create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [8, 16]}))
    fit_(teacher, train, val, FitSettings(epochs=2, lr=3e-3))
    student = create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [4, 8]}))
    xs = torch.from_numpy(val.x)
    run_teacher = onnx_forward(teacher, meta.input_shape, xs[:4], threads=1)
    with torch.no_grad():
        expected = teacher(xs)
    got = run_teacher(xs)
    # fp32 kernels of two runtimes: they agree to rounding, far below the logits' scale.
    assert got.shape == expected.shape
    assert float((got - expected).abs().max()) < 1e-4 * float(expected.abs().max())
    # Augmented inputs: the teacher runs on every batch, in PyTorch or on ONNX Runtime.
    settings = FitSettings(epochs=2, lr=3e-3, batch_size=32, crop_padding=1, hflip=True)
    students = [copy.deepcopy(student), copy.deepcopy(student)]
    fit_(students[0], train, val, settings, distillation=Distillation(teacher, 2.0, 0.5))
    fit_(students[1], train, val, settings, distillation=Distillation(teacher, 2.0, 0.5, run_teacher=run_teacher))
    for a, b in zip(students[0].parameters(), students[1].parameters(), strict=True):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-3)


def test_a_teacher_on_onnx_runtime_that_disagrees_with_pytorch_is_refused(tmp_path, monkeypatch):
    import pytest

    import pruneops.runtimes.onnxruntime.files
    from pruneops.core.errors import PruneOpsError
    from pruneops.training.fit import onnx_forward

    real = pruneops.runtimes.onnxruntime.files.make_session

    class Shifted:  # an export whose logits are off by one: what a wrong export would give
        def __init__(self, *args):
            self.session = real(*args)

        def run(self, *args):
            return [out + 1.0 for out in self.session.run(*args)]

    monkeypatch.setattr(pruneops.runtimes.onnxruntime.files, "make_session", Shifted)
    meta, _, val, _ = _digits(tmp_path)
    model = create_model(ModelSpec("cnn", meta.input_shape, 10, {"widths": [4, 8]}))
    with pytest.raises(PruneOpsError, match="differs from PyTorch by 1.00e\\+00 > 0.001.*teacher_runtime: torch"):
        onnx_forward(model, meta.input_shape, torch.from_numpy(val.x[:4]), threads=1)
