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


# The decoder app in a fresh interpreter without torch or transformers (the serving image has neither).
DECODER_SCRIPT = r"""
import importlib.abc, json, sys

class Blocked(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in ("torch", "transformers"):
            raise ImportError(f"{name} is blocked: the serving image has none")

sys.meta_path.insert(0, Blocked())
from pathlib import Path
from fastapi.testclient import TestClient
from pruneops.serving.generate import DecoderService, create_decoder_app
from pruneops.pipeline.stages import load_section

gate = load_section(sys.argv[2], "reprune", "params.yaml")
service = DecoderService(Path(sys.argv[1]), None, decode_slo_ms=gate.decode_slo_ms, prefill_slo_ms=gate.prefill_slo_ms)
client = TestClient(create_decoder_app(service))
plain = client.post("/generate", json={"prompt": "the people", "max_new_tokens": 4})
streamed = client.post("/generate", json={"prompt": "the people", "max_new_tokens": 4, "stream": True})
feedback = client.post("/feedback", json={"prompt": "the people", "continuation": "of our nation"})
print(json.dumps({
    "statuses": [plain.status_code, streamed.status_code, feedback.status_code],
    "tokens": plain.json()["tokens"],
    "done_event": "event: done" in streamed.text,
    "metrics": client.get("/metrics").text,
    "blocked_loaded": sorted({m.split(".")[0] for m in sys.modules} & {"torch", "transformers"}),
}))
"""


def test_decoder_generate_stream_and_feedback_without_torch(tmp_path, tiny_genai_decoder):
    import json

    from tests.conftest import write_params

    folder = tiny_genai_decoder[1]
    (tmp_path / "project").mkdir()
    write_params(tmp_path / "project", {"reprune": {"decode_slo_ms": 40.0, "prefill_slo_ms": 300.0}})
    out = subprocess.run(
        [sys.executable, "-c", DECODER_SCRIPT, str(folder), str(tmp_path / "project")],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["statuses"] == [200, 200, 200] and result["tokens"] == 4 and result["done_event"]
    assert result["blocked_loaded"] == []
    assert "pruneops_decode_slo_seconds 0.04" in result["metrics"]
    assert "pruneops_prefill_slo_seconds 0.3" in result["metrics"]
