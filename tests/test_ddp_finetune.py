"""Data-parallel fine-tuning under torchrun (DDP over gloo, 2 processes) against one process."""

import math
import shutil
import subprocess
import sys

import pytest

from pruneops.io import read_json
from tests.conftest import tiny_params, write_params


@pytest.mark.slow
def test_ddp_finetune_matches_single_process_within_the_test_sets_noise(pipeline_dir, tmp_path):
    accuracy, samples = {}, 0
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
        samples = read_json(root / "artifacts/validate/validation.json")["report"]["n_test"]
    # Two runs see the data in another order, so they are two models: each accuracy on n test images
    # has binomial standard error sqrt(p(1-p)/n), their difference sqrt(2p(1-p)/n). A bound of 3.5
    # of those (at least 3 images) is what noise allows here on any CPU; a broken DDP (ranks
    # diverging, or training on half the data) lands far outside it.
    p = (accuracy[1] + accuracy[2]) / 2
    bound = max(3.5 * math.sqrt(2 * p * (1 - p) / samples), 3 / samples)
    assert abs(accuracy[2] - accuracy[1]) <= bound, (accuracy, samples, bound)
    assert min(accuracy.values()) > 0.8
