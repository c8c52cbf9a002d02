import os

import pytest

from pruneops.model_registry import ModelRegistry, RegistryError


def _model(tmp_path, content: bytes):
    path = tmp_path / f"m{len(content)}.onnx"
    path.write_bytes(content)
    return path


def test_register_promote_and_rollback(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    assert reg.production() is None
    v1 = reg.register(_model(tmp_path, b"one"), {"data_hash": "a", "metrics": {"accuracy": 0.9}}, version="v1")
    v2 = reg.register(_model(tmp_path, b"two!"), {"data_hash": "b"}, version="v2")
    v3 = reg.register(_model(tmp_path, b"three"), {"data_hash": "c"}, version="v3")
    assert reg.versions() == ["v1", "v2", "v3"]
    assert v1.metadata["metrics"]["accuracy"] == 0.9 and v1.model_file.read_bytes() == b"one"

    reg.promote("v1", "first")
    reg.promote("v2", "better")
    reg.promote("v3", "better again")
    assert reg.production().version == "v3"
    assert (reg.production_link / "model.onnx").read_bytes() == b"three"
    assert os.path.islink(reg.production_link)

    assert reg.rollback().version == "v2"
    assert reg.production().model_file.read_bytes() == v2.model_file.read_bytes()
    assert reg.rollback().version == "v1"
    with pytest.raises(RegistryError, match="first production model"):
        reg.rollback()
    assert [e["action"] for e in reg.history()] == ["promote"] * 3 + ["rollback"] * 2
    assert v3.path.exists()  # rollback never deletes a version


def test_errors_and_no_leftovers(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    with pytest.raises(RegistryError, match="nothing is in production"):
        reg.rollback()
    with pytest.raises(RegistryError, match="no model version 'v9'"):
        reg.promote("v9")
    reg.register(_model(tmp_path, b"x"), {}, version="v1")
    with pytest.raises(RegistryError, match="already registered"):
        reg.register(_model(tmp_path, b"x"), {}, version="v1")
    reg.promote("v1")
    assert not [p for p in (tmp_path / "models").rglob(".*")]
