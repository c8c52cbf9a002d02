import errno
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from pruneops.modelstore.store import ModelRegistry, RegistryError
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
    assert not [p for p in (tmp_path / "models").rglob(".*") if p.name != ".lock"]


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


RACE = Path(__file__).resolve().parents[2] / "tests/sweep/registry_race.py"


def _race(*flags: str) -> list[dict]:
    out = subprocess.run(
        [sys.executable, str(RACE), "--repetitions", "1", "--operations", "60", *flags],
        capture_output=True,
        text=True,
        timeout=300,
    )
    return [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]


def test_two_processes_racing_lose_no_history_and_production_stays_the_top():
    (tally,) = _race()
    assert tally["exit_codes"] == [0, 0]
    assert tally["operations"] >= 60  # most of the 120 operations return (a rollback at the bottom does not)
    assert tally["lost"] == tally["extra"] == tally["corrupt"] == 0
    assert tally["production_is_top"]


def test_the_race_check_sees_lost_entries_without_the_lock():
    (tally,) = _race("--unlocked")
    assert tally["lost"] + tally["extra"] + tally["corrupt"] > 0 or not tally["production_is_top"]


def _flip(path: Path, n: int = 64) -> None:
    data = bytearray(path.read_bytes())
    for i in range(len(data) - n, len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def test_a_changed_model_file_is_refused_by_promote_and_rollback_before_anything_moves(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    for n in (1, 2):
        reg.register(_model(tmp_path, n), {}, version=f"v{n}")
    reg.promote("v1")
    _flip(reg.get("v2").model_file)
    with pytest.raises(RegistryError, match=r"v2/model.onnx: checksum mismatch"):
        reg.promote("v2")
    reg.promote(reg.register(_model(tmp_path, 3), {}, version="v3").version)
    _flip(reg.get("v1").model_file)
    with pytest.raises(RegistryError, match=r"cannot roll back to v1: .*checksum mismatch"):
        reg.rollback()
    assert reg.production().version == "v3" == Path(os.readlink(reg.production_link)).name
    assert [e["version"] for e in reg.history()] == ["v1", "v3"]


def test_rollback_onto_unreadable_metadata_moves_nothing(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    for n in (1, 2):
        reg.promote(reg.register(_model(tmp_path, n), {}, version=f"v{n}").version)
    (reg.get("v1").path / "metadata.json").write_text("{not json")
    with pytest.raises(RegistryError, match="cannot roll back to v1: .*metadata.json: unreadable"):
        reg.rollback()
    assert reg.production().version == "v2" == Path(os.readlink(reg.production_link)).name


def test_a_model_that_serves_other_inputs_is_refused_unless_the_change_is_declared(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    reg.promote(reg.register(_model(tmp_path, 1), {}, version="v1").version)
    wide = tiny_onnx(tmp_path / "wide.onnx", 2, features=64)
    reg.register(wide, {}, version="wide")
    with pytest.raises(RegistryError, match=r"serves other requests than production v1 \(inputs .*64"):
        reg.promote("wide")
    assert reg.production().version == "v1"
    reg.register(tiny_onnx(tmp_path / "more.onnx", 3, classes=5), {}, version="five")
    with pytest.raises(RegistryError, match="num_classes 5 instead of 3"):
        reg.promote("five")
    reg.promote("wide", "new input", allow_contract_change=True)
    assert reg.declared_contract_change("wide")
    with pytest.raises(RegistryError, match="cannot roll back to v1: .*serves other requests"):
        reg.rollback()  # back across the change is a change too
    assert reg.rollback(allow_contract_change=True).version == "v1"


def test_a_full_disk_leaves_production_and_history_as_they_were(tmp_path, monkeypatch):
    reg = ModelRegistry(tmp_path / "models")
    for n in (1, 2):
        reg.register(_model(tmp_path, n), {}, version=f"v{n}")
    reg.promote("v1")
    real_replace = os.replace

    def full(src, dst):
        if Path(dst).name == "history.json":
            raise OSError(errno.ENOSPC, "No space left on device")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full)
    with pytest.raises(RegistryError, match="cannot write .*No space left on device.*production is unchanged"):
        reg.promote("v2")
    monkeypatch.undo()
    assert reg.production().version == "v1" == Path(os.readlink(reg.production_link)).name
    assert [e["version"] for e in reg.history()] == ["v1"]
    assert not list(reg.root.glob(".*.tmp"))


def test_a_symlink_that_lags_history_is_moved_by_the_next_operation(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    for n in (1, 2, 3):
        reg.promote(reg.register(_model(tmp_path, n), {}, version=f"v{n}").version)
    os.symlink("candidates/v1", reg.root / ".stale")
    os.replace(reg.root / ".stale", reg.production_link)  # a crash between history and the link
    assert reg.production().version == "v3"  # history is the truth
    assert reg.rollback().version == "v2"
    assert Path(os.readlink(reg.production_link)).name == "v2"


def test_an_unreadable_history_is_refused_then_recovered_from_the_candidates(tmp_path):
    reg = ModelRegistry(tmp_path / "models")
    for n in (1, 2):
        reg.promote(reg.register(_model(tmp_path, n), {}, version=f"v{n}").version)
    reg.history_file.write_text('[{"action": "promote", "vers')
    (reg.root / ".history.999.1.abc.tmp").write_text("left by a killed process")
    with pytest.raises(RegistryError, match="history.json: unreadable .*pruneops recover"):
        reg.promote("v1")
    done = reg.recover()
    assert done["production"] == "v2"  # where the symlink pointed, and it serves
    assert done["removed"] == [".history.999.1.abc.tmp"]
    assert list(reg.root.glob("history.json.corrupt-*"))
    assert reg.production().version == "v2"
    reg.promote("v1")
    assert reg.served_stack() == ["v2", "v1"]
