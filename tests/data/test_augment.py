"""`train.augment` / `finetune.augment`: random crop with zero padding and horizontal flip of training batches."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from pruneops.config import AugmentConfig, ConfigError, TrainConfig
from pruneops.core.io import Layout
from pruneops.core.params import parse_section
from pruneops.data import load_prepared
from pruneops.data.augment import augment_images, check_augmentable
from pruneops.models.checkpoint import load_checkpoint
from pruneops.task.classification.train import train_baseline
from pruneops.task.classification.validate import ValidateConfig, validate_dataset


def _batch(n=64, c=2, h=7, w=9):
    return torch.arange(n * c * h * w, dtype=torch.float32).reshape(n, c, h, w) + 1.0  # no zero pixel


def test_each_crop_is_a_window_of_the_zero_padded_image():
    x, pad = _batch(), 3
    out = augment_images(x, pad, False, torch.Generator().manual_seed(0))
    assert out.shape == x.shape
    padded = F.pad(x, (pad,) * 4)
    offsets = set()
    for i in range(len(x)):
        found = [
            (dy, dx)
            for dy in range(2 * pad + 1)
            for dx in range(2 * pad + 1)
            if torch.equal(out[i], padded[i, :, dy : dy + x.shape[2], dx : dx + x.shape[3]])
        ]
        assert found, f"image {i} is no window of its padded self"
        offsets.add(found[0])
    # 64 draws of 49 offsets: far more than a handful must differ (a fixed crop is no augmentation).
    assert len(offsets) > 20
    assert torch.equal(x, _batch())  # the input is left as it was


def test_about_half_the_images_are_mirrored_and_the_rest_untouched():
    x = _batch(n=2000, c=1, h=3, w=4)
    out = augment_images(x, 0, True, torch.Generator().manual_seed(1))
    mirrored = torch.tensor([torch.equal(o, i.flip(-1)) for o, i in zip(out, x, strict=True)])
    kept = torch.tensor([torch.equal(o, i) for o, i in zip(out, x, strict=True)])
    assert bool((mirrored ^ kept).all())  # each image is one or the other, never anything else
    # Binomial(2000, 1/2): standard deviation 0.011; 4 of them either side.
    assert abs(mirrored.float().mean().item() - 0.5) < 4 * (0.25 / 2000) ** 0.5


def test_the_same_seed_gives_the_same_batches():
    x = _batch()
    first = augment_images(x, 2, True, torch.Generator().manual_seed(7))
    assert torch.equal(first, augment_images(x, 2, True, torch.Generator().manual_seed(7)))
    assert not torch.equal(first, augment_images(x, 2, True, torch.Generator().manual_seed(8)))


def test_params_are_validated_and_non_images_refused():
    with pytest.raises(ConfigError, match="crop_padding"):
        parse_section("train", {"augment": {"crop_padding": -1}}, TrainConfig)
    with pytest.raises(ConfigError, match="augment"):
        parse_section("train", {"augment": {"rotate": 10}}, TrainConfig)
    with pytest.raises(ConfigError, match=r"need images .*\(20,\)"):
        check_augmentable("train", AugmentConfig(hflip=True), [20])
    check_augmentable("train", AugmentConfig(), [20])  # nothing asked: nothing to refuse
    check_augmentable("train", AugmentConfig(crop_padding=2), [1, 8, 8])


def test_training_with_augmentation_sees_other_batches_and_still_learns(tmp_path):
    layout = Layout(tmp_path)
    validate_dataset(ValidateConfig(), layout)  # the embedded digits, 1x8x8
    _, _, val, _ = load_prepared(layout.stage_dir("validate"))
    spec = {"model": "cnn", "model_kwargs": {"widths": [8, 16]}, "epochs": 3, "lr": 3e-3}
    plain = train_baseline(TrainConfig(**spec), layout)
    plain_weights = load_checkpoint(plain.checkpoint).model.state_dict()
    augmented = train_baseline(TrainConfig(**spec, augment=AugmentConfig(crop_padding=1)), layout)
    augmented_weights = load_checkpoint(augmented.checkpoint).model.state_dict()
    chance = 1 / len(np.unique(val.y))
    # Both learn (far above chance); the augmented run trained on other inputs, so to other weights.
    assert augmented.val_accuracy > 5 * chance and plain.val_accuracy > 5 * chance
    assert any(not torch.equal(plain_weights[k], augmented_weights[k]) for k in plain_weights)
