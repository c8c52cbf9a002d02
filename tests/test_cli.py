"""Bad input through the command line: one clear line, non-zero exit, no partial output."""

import subprocess
import sys

import numpy as np
import pytest

from pruneops.cli import main
from tests.conftest import tiny_params, write_params


def _run(tmp_path, *args):
    return subprocess.run(
        [
            sys.executable,
            "-m",
            "pruneops.cli",
            "--params",
            str(tmp_path / "params.yaml"),
            "--root",
            str(tmp_path),
            *args,
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )


def _error_lines(stderr):
    return [line for line in stderr.splitlines() if line.strip()]


def test_help_lists_every_stage(capsys):
    try:
        main(["--help"])
    except SystemExit as exc:
        assert exc.code == 0
    out = capsys.readouterr().out
    for stage in (
        "validate",
        "train",
        "sensitivity",
        "latency",
        "prune",
        "finetune",
        "quantize",
        "export",
        "benchmark",
        "methods",
    ):
        assert stage in out


def test_methods_lists_registries(capsys):
    assert main(["methods"]) == 0
    out = capsys.readouterr().out
    assert "channel" in out and "magnitude" in out and "transformer" in out and "static" in out


def test_bad_param_exits_2_with_one_line_and_writes_nothing(tmp_path):
    write_params(tmp_path, tiny_params(prune={"target": {"kind": "ratio", "value": 1.5}}))
    result = _run(tmp_path, "prune")
    assert result.returncode == 2
    assert _error_lines(result.stderr) == [
        "pruneops prune: error: prune.target.value: a ratio must be less than 1 (got 1.5)"
    ]
    assert not (tmp_path / "artifacts").exists() and not (tmp_path / "metrics").exists()


def test_a_stage_records_its_exit_code_and_error_line_for_what_drives_it(tmp_path):
    """The Prefect tasks read how a stage ended from the stage, not from DVC's wording of it."""
    from pruneops.pipeline.runner import read_outcome

    write_params(tmp_path, tiny_params(prune={"target": {"kind": "ratio", "value": 1.5}}))
    result = _run(tmp_path, "prune")
    outcome = read_outcome(tmp_path, "prune")
    assert (outcome.stage, outcome.exit_code) == ("prune", result.returncode) == ("prune", 2)
    assert _error_lines(result.stderr) == [outcome.error]
    write_params(tmp_path, tiny_params())
    result = _run(tmp_path, "validate")
    outcome = read_outcome(tmp_path, "validate")
    assert result.returncode == 0 and (outcome.exit_code, outcome.error) == (0, "") and outcome.seconds > 0
    assert read_outcome(tmp_path, "train") is None


def test_wrong_type_and_unknown_key(tmp_path):
    write_params(tmp_path, tiny_params(train={"epochs": "many"}))
    result = _run(tmp_path, "train")
    assert result.returncode == 2 and "train.epochs: must be a valid integer" in result.stderr
    write_params(tmp_path, tiny_params(validate={"datset": "digits"}))
    result = _run(tmp_path, "validate")
    assert result.returncode == 2 and "validate.datset: unknown key" in result.stderr


def test_missing_and_corrupt_data_files(tmp_path):
    write_params(tmp_path, tiny_params(validate={"dataset": "npz", "path": str(tmp_path / "none.npz")}))
    result = _run(tmp_path, "validate")
    assert result.returncode == 1
    assert _error_lines(result.stderr) == [f"pruneops validate: error: {tmp_path / 'none.npz'}: data file not found"]
    (tmp_path / "bad.npz").write_bytes(b"garbage")
    write_params(tmp_path, tiny_params(validate={"dataset": "npz", "path": str(tmp_path / "bad.npz")}))
    result = _run(tmp_path, "validate")
    assert result.returncode == 1 and "not a readable NPZ archive" in result.stderr
    assert len(_error_lines(result.stderr)) == 1
    assert not (tmp_path / "artifacts").exists()


def test_nan_in_data_stops_validate_with_summary(tmp_path):
    rng = np.random.default_rng(0)
    x = rng.random((60, 4, 4)).astype(np.float32)
    x[3, 1, 1] = np.nan
    np.savez(
        tmp_path / "d.npz",
        x_train=x,
        y_train=np.arange(60) % 3,
        x_test=rng.random((20, 4, 4)).astype(np.float32),
        y_test=np.arange(20) % 3,
    )
    write_params(tmp_path, tiny_params(validate={"dataset": "npz", "path": str(tmp_path / "d.npz")}))
    result = _run(tmp_path, "validate")
    assert result.returncode == 1
    first = result.stderr.splitlines()[0]
    assert first.startswith("pruneops validate: error: data validation failed: 1 of ")
    assert "n_nonfinite" in first
    assert not (tmp_path / "artifacts").exists()


def test_corrupt_checkpoint_fails_prune_and_leaves_no_output(pipeline_dir, tmp_path):
    import shutil

    for part in ("artifacts/validate", "artifacts/train", "artifacts/sensitivity"):
        shutil.copytree(pipeline_dir / part, tmp_path / part)
    shutil.copy(pipeline_dir / "params.yaml", tmp_path / "params.yaml")
    ckpt = tmp_path / "artifacts/train/model.safetensors"
    data = bytearray(ckpt.read_bytes())
    for i in range(len(data) - 2000, len(data)):  # 2,000 flipped bytes of tensor data; the header intact
        data[i] ^= 0x5A
    ckpt.write_bytes(bytes(data))
    result = _run(tmp_path, "prune")
    assert result.returncode == 1
    (line,) = _error_lines(result.stderr)
    assert line.startswith(f"pruneops prune: error: {ckpt}: checksum mismatch")
    assert not (tmp_path / "artifacts/prune").exists() and not (tmp_path / "metrics/prune.json").exists()
    assert not list((tmp_path / "artifacts").glob(".*tmp*"))


def test_a_baseline_that_no_longer_reaches_its_recorded_accuracy_stops_the_next_stage(pipeline_dir, tmp_path):
    import shutil

    from pruneops.models import create_model
    from pruneops.models.checkpoint import load_checkpoint, save_checkpoint

    for part in ("artifacts/validate", "artifacts/train"):
        shutil.copytree(pipeline_dir / part, tmp_path / part)
    shutil.copy(pipeline_dir / "params.yaml", tmp_path / "params.yaml")
    ckpt = tmp_path / "artifacts/train/model.safetensors"
    trained = load_checkpoint(ckpt)
    save_checkpoint(ckpt, create_model(trained.spec), trained.spec, trained.extra)  # untrained, valid checksum
    result = _run(tmp_path, "sensitivity")
    assert result.returncode == 1
    (line,) = _error_lines(result.stderr)
    assert "is far below the" in line and "recorded when it was trained" in line
    assert not (tmp_path / "artifacts/sensitivity").exists()


def test_failure_mid_stage_keeps_previous_outputs(pipeline_dir, tmp_path, monkeypatch):
    import shutil

    from pruneops.core.errors import ParityError
    from pruneops.pipeline.runner import run_stage
    from pruneops.task.classification import export as export_module

    for part in ("artifacts", "metrics"):
        shutil.copytree(pipeline_dir / part, tmp_path / part)
    shutil.copy(pipeline_dir / "params.yaml", tmp_path / "params.yaml")
    before = (tmp_path / "artifacts/export/pruned_fp32.onnx").read_bytes()

    def failing_parity(*args, **kwargs):
        raise ParityError("injected")

    monkeypatch.setattr(export_module, "check_parity", failing_parity)
    with pytest.raises(ParityError, match="injected"):
        run_stage("export", tmp_path / "params.yaml", tmp_path)
    assert (tmp_path / "artifacts/export/pruned_fp32.onnx").read_bytes() == before
    assert not [p for p in (tmp_path / "artifacts").iterdir() if p.name.startswith(".")]


def test_publish_promotes_only_the_first_model_unless_forced(pipeline_dir, tmp_path, capsys):
    import json
    import shutil

    from pruneops.modelstore.store import REFERENCE_STATS, ModelRegistry

    root = tmp_path / "project"
    root.mkdir()
    shutil.copy(pipeline_dir / "params.yaml", root / "params.yaml")
    assert main(["--root", str(root), "publish"]) == 1
    assert "run `dvc repro` first" in capsys.readouterr().err
    shutil.copytree(pipeline_dir / "artifacts", root / "artifacts")
    shutil.copytree(pipeline_dir / "metrics", root / "metrics")
    results = []
    for extra in ([], [], ["--promote"]):
        assert main(["--root", str(root), "publish", *extra]) == 0
        results.append(json.loads(capsys.readouterr().out))
    assert [r["promoted"] for r in results] == [True, False, True]
    registry = ModelRegistry(root / "models")
    assert registry.production().version == results[2]["version"]
    first = registry.get(results[0]["version"])
    assert (first.path / REFERENCE_STATS).read_bytes() == (
        root / "artifacts/validate/reference_stats.json"
    ).read_bytes()
    assert first.metadata["metrics"]["models"]["pruned_deployed"]["test_accuracy"] > 0.5


def test_temporary_outputs_of_a_killed_stage_are_swept_by_the_next_run(tmp_path):
    import os

    from pruneops.core.io import staged_output_paths

    final = tmp_path / "artifacts" / "train"
    final.parent.mkdir(parents=True)
    dead = final.parent / ".train.tmp-999999999-abc"  # no such process
    legacy = final.parent / ".train.tmp-xyz"  # written before twins carried a pid
    live = final.parent / f".train.tmp-{os.getpid()}-other"  # a run still going in this process
    for d in (dead, legacy, live):
        (d / "train").mkdir(parents=True)
    with staged_output_paths(final) as staged:
        (staged.dir(final) / "model.txt").write_text("new")
    assert not dead.exists() and not legacy.exists() and live.exists()
    assert (final / "model.txt").read_text() == "new"


@pytest.mark.slow
def test_a_training_stage_shows_one_line_per_epoch(tmp_path):
    write_params(tmp_path, tiny_params(train={"epochs": 2, "model": "mlp", "model_kwargs": {"hidden": [16]}}))
    assert _run(tmp_path, "validate").returncode == 0
    result = _run(tmp_path, "train")
    assert result.returncode == 0, result.stderr
    epochs = [line for line in result.stderr.splitlines() if " pruneops.training.fit: train epoch " in line]
    assert [line.split("train epoch ")[1].split(":")[0] for line in epochs] == ["1/2", "2/2"], result.stderr
    assert "val acc" in epochs[-1] and result.stdout.startswith("pruneops train (")


def test_the_bench_shows_the_progress_of_its_own_long_steps(tmp_path, monkeypatch, capsys):
    """`pruneops bench` times and scores every row in its own process: that step's progress is shown too."""
    import logging

    import pruneops.compare.run
    from pruneops.compare.run import BenchReport
    from pruneops.core.progress import Progress

    logger = logging.getLogger("pruneops")
    monkeypatch.setattr(logger, "handlers", [])  # as in a fresh process (restored afterwards)
    monkeypatch.setattr(logger, "level", logger.level)

    def bench(*args):  # a long step of the bench's own: the scoring of its rows
        clock = iter([0.0, 30.0, 30.0])
        with Progress("bench: scoring", 1, "models", clock=lambda: next(clock)) as counter:
            counter.update()
        return BenchReport(rows={}, selected={}, failed={}, reports={})

    monkeypatch.setattr(pruneops.compare.run, "run_bench_file", bench)
    assert main(["--root", str(tmp_path), "bench", "--config", str(tmp_path / "bench.yaml")]) == 0
    assert "INFO pruneops: bench: scoring: 1/1 models (100%)" in capsys.readouterr().err
