"""The serving path runs without torch: the serving image ships ONNX Runtime and no torch."""

import shutil
import subprocess
import sys

import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed")

# Runs in a fresh interpreter where any import of torch fails, as in the serving image.
SCRIPT = r"""
import importlib.abc, json, sys

class NoTorch(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "torch" or name.startswith("torch."):
            raise ImportError("torch is blocked: the serving image has none")

sys.meta_path.insert(0, NoTorch())
root = sys.argv[1]
from pruneops.cli import main

assert main(["--root", root, "publish"]) == 0
from fastapi.testclient import TestClient
from pathlib import Path
import numpy as np
from pruneops.serving.app import ServingConfig, create_app

config = ServingConfig(production=Path(root) / "models/production", reference_stats=None, drift_min_samples=10)
with np.load(Path(root) / "artifacts/validate/test.npz") as test:
    x = test["x"][:32]
with TestClient(create_app(config)) as client:
    r = client.post("/predict", json={"inputs": x.tolist()})
    assert r.status_code == 200, r.text
    metrics = client.get("/metrics").text
print(json.dumps({
    "classes": r.json()["classes"],
    "drift_scored": 'pruneops_drift_score{group="overall"}' in metrics,
    "torch_loaded": any(m == "torch" or m.startswith("torch.") for m in sys.modules),
}))
"""


def test_publish_and_serve_without_torch(pipeline_dir, tmp_path):
    for name in ("artifacts", "metrics", "params.yaml"):
        copy = shutil.copytree if (pipeline_dir / name).is_dir() else shutil.copy
        copy(pipeline_dir / name, tmp_path / name)
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, str(tmp_path)], capture_output=True, text=True, timeout=120, check=False
    )
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    import numpy as np

    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["torch_loaded"] is False
    assert result["drift_scored"] is True  # the published model brought its reference statistics
    with np.load(tmp_path / "artifacts/validate/test.npz") as test:
        accuracy = np.mean(np.array(result["classes"]) == test["y"][:32])
    assert accuracy >= 0.8
