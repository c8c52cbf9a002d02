"""Data-parallel fine-tuning under torchrun (DDP over gloo, 2 processes) against one process."""

import shutil
import subprocess
import sys

import pytest

from pruneops.io import read_json
from tests.conftest import tiny_params, write_params


@pytest.mark.slow
def test_ddp_finetune_matches_single_process_within_a_point(pipeline_dir, tmp_path):
    accuracy = {}
    for world in (1, 2):
        root = tmp_path / f"w{world}"
        for part in ("validate", "train", "prune"):
            shutil.copytree(pipeline_dir / "artifacts" / part, root / "artifacts" / part)
        params = write_params(root, tiny_params(finetune={"world_size": world, "epochs": 12, "patience": 12}))
        result = subprocess.run(
            [sys.executable, "-m", "pruneops.cli", "--params", str(params), "--root", str(root), "finetune"],
            capture_output=True,
            text=True,
            timeout=600,
        )
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.count("pruneops finetune (") == 1  # rank 0 alone reports
        metrics = read_json(root / "metrics/finetune.json")
        assert metrics["world_size"] == world
        accuracy[world] = metrics["test_accuracy"]
    assert abs(accuracy[2] - accuracy[1]) <= 0.01
