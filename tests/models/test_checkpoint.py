import shutil

import numpy as np
import pytest
import torch
from safetensors import safe_open

from pruneops.core.errors import CheckpointError
from pruneops.core.integrity import checksum_path, file_sha256
from pruneops.models import ModelSpec, create_model
from pruneops.models.checkpoint import check_recorded_accuracy, load_checkpoint, save_checkpoint
from pruneops.pruning.importance import IMPORTANCES
from pruneops.pruning.units import UnitPruner, round_keep


@pytest.mark.parametrize("name", ["mlp", "cnn", "transformer"])
def test_pruned_model_reloads_with_its_shapes(tmp_path, name):
    spec = ModelSpec(name, [1, 8, 8], 10)
    model = create_model(spec).eval()
    x = torch.randn(3, 1, 8, 8)
    pruner = UnitPruner(model, x[:1], IMPORTANCES.get("l2"))
    pruner.prune_to_({n: round_keep(u.size, 0.5, None) for n, u in pruner.units().items()})
    save_checkpoint(tmp_path / "m.safetensors", model, spec, {"note": 1})
    loaded = load_checkpoint(tmp_path / "m.safetensors")
    assert loaded.extra == {"note": 1}
    torch.testing.assert_close(loaded.model(x), model(x))
    assert sum(p.numel() for p in loaded.model.parameters()) == sum(p.numel() for p in model.parameters())


def test_corrupt_and_missing_checkpoints_raise_checkpoint_error(tmp_path):
    spec = ModelSpec("mlp", [1, 8, 8], 10)
    path = tmp_path / "m.safetensors"
    digest = save_checkpoint(path, create_model(spec), spec)
    assert checksum_path(path).read_text().split()[0] == digest == file_sha256(path)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="no recorded checksum"):
        load_checkpoint(tmp_path / "trunc.safetensors")
    shutil.copy(checksum_path(path), checksum_path(tmp_path / "trunc.safetensors"))
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(tmp_path / "trunc.safetensors")
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_flipped_bytes_in_the_tensor_data_are_caught_although_the_header_is_intact(tmp_path):
    spec = ModelSpec("mlp", [1, 8, 8], 10)
    path = tmp_path / "m.safetensors"
    save_checkpoint(path, create_model(spec), spec)
    data = bytearray(path.read_bytes())
    header = 8 + int.from_bytes(data[:8], "little")
    rng = np.random.default_rng(0)
    for i in rng.choice(np.arange(header, len(data)), 2000, replace=False):
        data[i] ^= 0xFF
    path.write_bytes(bytes(data))
    with safe_open(str(path), framework="pt") as f:  # still a readable file: only the checksum tells
        assert f.metadata()["pruneops"]
    with pytest.raises(CheckpointError, match="checksum mismatch"):
        load_checkpoint(path)


def test_a_baseline_far_below_its_recorded_accuracy_is_refused(tmp_path):
    spec = ModelSpec("mlp", [1, 8, 8], 10)
    save_checkpoint(tmp_path / "m.safetensors", create_model(spec), spec, {"val_accuracy": 0.995})
    checkpoint = load_checkpoint(tmp_path / "m.safetensors")
    check_recorded_accuracy(checkpoint, 0.99, 216, tmp_path / "m.safetensors")  # within 4 SE / 2 points
    with pytest.raises(CheckpointError, match=r"9.70% is far below the 99.50% recorded"):
        check_recorded_accuracy(checkpoint, 0.097, 216, tmp_path / "m.safetensors")


def test_checkpoint_of_other_architecture_is_refused(tmp_path):
    spec = ModelSpec("mlp", [1, 8, 8], 10, {"hidden": [16]})
    save_checkpoint(
        tmp_path / "m.safetensors", create_model(ModelSpec("mlp", [1, 8, 8], 10, {"hidden": [16, 16]})), spec
    )
    with pytest.raises(CheckpointError, match="does not fit its architecture"):
        load_checkpoint(tmp_path / "m.safetensors")
