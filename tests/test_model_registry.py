import os

import pytest

from pruneops.registry.store import ModelRegistry, RegistryError
from tests.conftest import tiny_onnx


def _model(tmp_path, seed: int):
    return tiny_onnx(tmp_path / f"m{seed}.onnx", seed)


def test_register_promote_and_rollback(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    assert reg.production() is None
    v1 = reg.register(_model(tmp_path, 1), {"data_hash": "a", "metrics": {"accuracy": 0.9}}, version="v1")
    v2 = reg.register(_model(tmp_path, 2), {"data_hash": "b"}, version="v2")
    v3 = reg.register(_model(tmp_path, 3), {"data_hash": "c"}, version="v3")
    assert reg.versions() == ["v1", "v2", "v3"]
    assert v1.metadata["metrics"]["accuracy"] == 0.9
    assert v1.model_file.read_bytes() == (tmp_path / "m1.onnx").read_bytes()

    reg.promote("v1", "first")
    reg.promote("v2", "better")
    reg.promote("v3", "better again")
    assert reg.production().version == "v3"
    assert (reg.production_link / "model.onnx").read_bytes() == (tmp_path / "m3.onnx").read_bytes()
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
    reg.register(_model(tmp_path, 1), {}, version="v1")
    with pytest.raises(RegistryError, match="already registered"):
        reg.register(_model(tmp_path, 1), {}, version="v1")
    reg.promote("v1")
    assert not [p for p in (tmp_path / "models").rglob(".*")]


@pytest.mark.parametrize(
    ("model", "reference", "why"),
    [
        (b"not onnx", None, "cannot serve this model"),
        (None, '{"bin_edges": [0, 1]', "cannot serve this model"),  # truncated JSON
        (
            None,
            '{"bin_edges": [0, 0.5, 1], "histograms": [[1.0]], "quantile_levels": [0, 1], '
            '"quantiles": [[0, 1]], "classes": [0], "class_frequencies": [1], "feature_groups": {"a": [0]}}',
            "histograms do not match bin_edges",
        ),
    ],
)
def test_promote_refuses_a_model_that_does_not_load_and_run(tmp_path, model, reference, why):
    reg = ModelRegistry(tmp_path / "models")
    reg.promote(reg.register(_model(tmp_path, 1), {}, version="good").version)
    bad = tmp_path / "bad.onnx"
    bad.write_bytes(model) if model is not None else tiny_onnx(bad, 2)
    ref = None
    if reference is not None:
        ref = tmp_path / "ref.json"
        ref.write_text(reference)
    reg.register(bad, {}, version="bad", reference_stats=ref)
    with pytest.raises(RegistryError, match=why):
        reg.promote("bad")
    assert reg.production().version == "good"
    assert [e["version"] for e in reg.history()] == ["good"]
