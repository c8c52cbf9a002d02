import copy

import torch

from pruneops.data import load_prepared
from pruneops.io import Layout
from pruneops.models import ModelSpec, create_model
from pruneops.training import Distillation, FitSettings, evaluate, fit_
from pruneops.validate import ValidateConfig, validate_dataset


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


def test_early_stopping_stops_before_epoch_budget(tmp_path):
    meta, train, val, _ = _digits(tmp_path)
    model = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [8]}))
    fit = fit_(model, train, val, FitSettings(epochs=200, lr=0.5, patience=2))
    assert len(fit.history) < 200
    assert len(fit.history) - fit.best_epoch == 2


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
    from pruneops.training import recalibrate_batchnorm_

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

    from pruneops.errors import PruneOpsError
    from pruneops.inputs import head_tensors
    from pruneops.pruning import IMPORTANCES, UnitPruner
    from pruneops.training import BlockTaps, repeated_blocks

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

    from pruneops.training import channels_last_

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
