import pytest
import torch

from pruneops.checkpoint import load_checkpoint, save_checkpoint
from pruneops.errors import CheckpointError
from pruneops.models import ModelSpec, create_model
from pruneops.pruning import IMPORTANCES, UnitPruner, round_keep


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
    save_checkpoint(path, create_model(spec), spec)
    data = path.read_bytes()
    (tmp_path / "trunc.safetensors").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="corrupt checkpoint"):
        load_checkpoint(tmp_path / "trunc.safetensors")
    (tmp_path / "junk.safetensors").write_bytes(b"\x00" * 64)
    with pytest.raises(CheckpointError):
        load_checkpoint(tmp_path / "junk.safetensors")
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.safetensors")


def test_checkpoint_of_other_architecture_is_refused(tmp_path):
    spec = ModelSpec("mlp", [1, 8, 8], 10, {"hidden": [16]})
    save_checkpoint(
        tmp_path / "m.safetensors", create_model(ModelSpec("mlp", [1, 8, 8], 10, {"hidden": [16, 16]})), spec
    )
    with pytest.raises(CheckpointError, match="does not fit its architecture"):
        load_checkpoint(tmp_path / "m.safetensors")
