"""Data-parallel fine-tuning under torchrun (DDP over gloo) against one process, on one node and on two.

- two processes on one node (`--standalone`) fine-tune to the one-process result within the test
  set's noise;
- two nodes of one process each, meeting at a c10d rendezvous on 127.0.0.1, are the same two ranks
  on the same shards with the same all-reduce: the same model as the one-node run, exactly.
"""

import math
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from pruneops.core.io import read_json
from tests.conftest import free_port, tiny_params, write_params


def _project(pipeline_dir, root, **finetune):
    for part in ("validate", "train", "prune"):
        shutil.copytree(pipeline_dir / "artifacts" / part, root / "artifacts" / part)
    params = write_params(root, tiny_params(finetune={"epochs": 12, "patience": 12, **finetune}))
    return [sys.executable, "-m", "pruneops.cli", "--params", str(params), "--root", str(root), "finetune"]


@pytest.mark.slow
def test_ddp_finetune_matches_single_process_within_the_test_sets_noise(pipeline_dir, tmp_path):
    metrics, samples = {}, 0
    for world in (1, 2):
        cmd = _project(pipeline_dir, tmp_path / f"w{world}", nproc_per_node=world)
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        assert result.returncode == 0, result.stderr[-2000:]
        assert result.stdout.count("pruneops finetune (") == 1  # rank 0 alone reports
        metrics[world] = read_json(tmp_path / f"w{world}" / "metrics/finetune.json")
        assert metrics[world]["world_size"] == world
        samples = read_json(tmp_path / f"w{world}" / "artifacts/validate/validation.json")["report"]["n_test"]
    accuracy = {w: m["test_accuracy"] for w, m in metrics.items()}
    # Two runs see the data in another order, so they are two models: each accuracy on n test images
    # has binomial standard error sqrt(p(1-p)/n), their difference sqrt(2p(1-p)/n). A bound of 3.5
    # of those (at least 3 images) is what noise allows here on any CPU; a broken DDP (ranks
    # diverging, or training on half the data) lands far outside it.
    p = (accuracy[1] + accuracy[2]) / 2
    bound = max(3.5 * math.sqrt(2 * p * (1 - p) / samples), 3 / samples)
    assert abs(accuracy[2] - accuracy[1]) <= bound, (accuracy, samples, bound)
    assert min(accuracy.values()) > 0.8

    # The same two ranks as two nodes of one process each (c10d rendezvous on 127.0.0.1).
    root = tmp_path / "nodes"
    endpoint = f"127.0.0.1:{free_port()}"
    cmd = _project(pipeline_dir, root, nproc_per_node=1, nnodes=2, rdzv_endpoint=endpoint)
    nodes = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(2)]
    outputs = [node.communicate(timeout=600) for node in nodes]
    for node, (_, err) in zip(nodes, outputs, strict=True):
        assert node.returncode == 0, err[-2000:]
    assert sum(out.count("pruneops finetune (") for out, _ in outputs) == 1  # rank 0 alone reports
    two_nodes = read_json(root / "metrics/finetune.json")
    assert two_nodes["world_size"] == 2
    for key in ("test_accuracy", "val_accuracy", "epochs_run", "distilled_epochs"):
        assert two_nodes[key] == metrics[2][key], key
    one_node = load_file(str(tmp_path / "w2" / "artifacts/finetune/model.safetensors"))
    both = load_file(str(root / "artifacts/finetune/model.safetensors"))
    assert one_node.keys() == both.keys()
    assert all(torch.equal(one_node[k], both[k]) for k in one_node)
