"""Shared fixtures: tiny params, and a pipeline run once per session on digits."""

from __future__ import annotations

import copy
import shutil
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
MNIST = ROOT.parent / "shared" / "data" / "mnist.npz"

# Small enough that every stage takes a second or two on 2 cores.
TINY_OVERRIDES = {
    "train": {"epochs": 8, "model_kwargs": {"widths": [16, 32]}, "patience": 3},
    "sensitivity": {"ratios": [0.25, 0.5, 0.75]},
    # A ratio target keeps the session pipeline fast, and timing (noisy on a 16-channel model) does
    # not gate it; the latency path and the gate have tests of their own.
    "prune": {
        "steps": 2,
        "epochs_per_step": 2,
        # Every key of the block written, as in params.yaml: `dvc exp run -S` sets only keys the file holds.
        "target": {"kind": "ratio", "value": 0.5, "batch": None, "reference": None, "form": "fp32"},
        "gate": {"min_speedup": None, "max_accuracy_drop": None},
    },
    "finetune": {"epochs": 4, "patience": 2},
    "quantize": {"latency_repeats": 20, "calibration_samples": 64},
    "export": {"parity_samples": 32},
    "benchmark": {"repeats": 10, "rounds": 2, "warmup": 2, "batch_sizes": [1, 8]},
}


def prune_section(method: str, target: float | None = None, **extra) -> dict:
    """The `prune` keys that method takes (a key a method does not take is refused at load)."""
    section: dict = {
        "method": method,
        "target": {"kind": "ratio", "value": 0.5 if target is None else target},
        "importance": "l2",
        "scope": None,
    }
    if method == "semi_structured":
        section.update(target=None, importance=None)
    elif method == "movement":
        section.update(importance=None)
    return {**section, **extra}


def tiny_params(**sections: dict) -> dict:
    """The project's params.yaml with tiny epochs, updated per section by `sections`."""
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    for section, values in {**TINY_OVERRIDES}.items():
        params[section].update(copy.deepcopy(values))
    for section, values in sections.items():
        params[section].update(values)
    return params


def write_params(directory: Path, params: dict) -> Path:
    """Writes `params` as `directory/params.yaml`."""
    path = directory / "params.yaml"
    path.write_text(yaml.safe_dump(params, sort_keys=False))
    return path


@pytest.fixture(scope="session")
def pipeline_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A directory where every stage ran once on digits with tiny settings."""
    from pruneops.pipeline.runner import run_stage
    from pruneops.pipeline.stages import STAGE_NAMES

    root = tmp_path_factory.mktemp("pipeline")
    params = write_params(root, tiny_params())
    for stage in STAGE_NAMES:
        run_stage(stage, params, root)
    return root


@pytest.fixture
def project_copy(tmp_path: Path) -> Path:
    """A copy of the project's pipeline files (dvc.yaml, params.yaml) in a fresh directory."""
    for name in ("dvc.yaml", "params.yaml"):
        shutil.copy(ROOT / name, tmp_path / name)
    return tmp_path


_DIGITS_BUILT: dict[bool, Path] = {}  # trained or not -> a directory holding the prepared data and model.onnx


def _build_digits_onnx(root: Path, trained: bool) -> Path:
    """Prepares digits under `root` and exports a small MLP (trained 4 epochs, or untrained) to `root/model.onnx`."""
    import torch

    from pruneops.core.io import Layout
    from pruneops.data import load_prepared
    from pruneops.models import ModelSpec, create_model
    from pruneops.runtimes.onnxruntime.files import export_onnx_file
    from pruneops.task.classification.validate import ValidateConfig, validate_dataset
    from pruneops.training.fit import FitSettings, fit_

    data_dir = validate_dataset(ValidateConfig(), Layout(root)).data_dir
    meta, train, val, _ = load_prepared(data_dir)
    torch.manual_seed(0)
    model = create_model(ModelSpec("mlp", meta.input_shape, 10, {"hidden": [64]}))
    if trained:
        fit_(model, train, val, FitSettings(epochs=4, lr=3e-3))
    export_onnx_file(model, meta.input_shape, root / "model.onnx", 18)
    return root


def digits_onnx(root: Path, trained: bool = True, name: str = "m.onnx"):
    """Digits prepared under `root` and a small MLP (trained 4 epochs, or untrained) as `root/name`.

    Built once per session and copied: the model is seeded, so every copy is the same model.

    Returns:
        (data directory, ONNX path, test split).
    """
    import atexit
    import tempfile

    from pruneops.core.io import Layout
    from pruneops.data import load_prepared

    if trained not in _DIGITS_BUILT:
        built = Path(tempfile.mkdtemp(prefix="pruneops-digits-"))
        atexit.register(shutil.rmtree, built, True)
        _DIGITS_BUILT[trained] = _build_digits_onnx(built, trained)
    built = _DIGITS_BUILT[trained]
    root.mkdir(parents=True, exist_ok=True)
    shutil.copytree(built, root, dirs_exist_ok=True, ignore=shutil.ignore_patterns("model.onnx"))
    shutil.copyfile(built / "model.onnx", root / name)
    data_dir = Layout(root).stage_dir("validate")
    return data_dir, root / name, load_prepared(data_dir)[3]


def tiny_onnx(path: Path, seed: int = 0, features: int = 4, classes: int = 3) -> Path:
    """A small valid classifier as ONNX (logits = x @ W), different per seed."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    weights = np.random.default_rng(seed).standard_normal((features, classes)).astype(np.float32)
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["input", "W"], ["logits"])],
        "tiny",
        [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["batch", features])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", classes])],
        [numpy_helper.from_array(weights, "W")],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 9  # what this ONNX Runtime reads (the onnx package writes newer by default)
    onnx.save(model, str(path))
    return path


def png_bomb(side: int = 30_000) -> bytes:
    """A PNG whose header promises side x side pixels (a decompression bomb), a few bytes long."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    header = struct.pack(">IIBBBBB", side, side, 8, 0, 0, 0, 0)
    body = chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(b"\0" * 64)) + chunk(b"IEND", b"")
    return b"\x89PNG\r\n\x1a\n" + body


def free_port() -> int:
    """A free TCP port on loopback."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_http(url: str, timeout: float = 30.0) -> None:
    """Polls `url` until it answers (bounded by `timeout`)."""
    import time
    import urllib.request

    deadline = time.time() + timeout
    while time.time() < deadline:
        try:
            with urllib.request.urlopen(url, timeout=2):
                return
        except OSError:
            time.sleep(0.3)
    raise TimeoutError(url)


def post_json(url: str, body: dict, headers: dict | None = None, timeout: float = 30.0) -> dict:
    """POSTs `body` as JSON and returns the decoded JSON answer."""
    import json
    import urllib.request

    request = urllib.request.Request(
        url,
        data=json.dumps(body).encode(),
        method="POST",
        headers={"content-type": "application/json", **(headers or {})},
    )
    with urllib.request.urlopen(request, timeout=timeout) as response:
        return json.load(response)


@pytest.fixture(scope="session")
def tiny_genai_decoder(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A tiny random Llama: its HuggingFace folder and its onnxruntime-genai export (fp32, 1 thread).

    Tests copy or register it before changing anything in it.
    """
    pytest.importorskip("onnxruntime_genai", reason="the llm extra (onnxruntime-genai) is not installed")
    from pruneops.runtimes.genai.generation import build_genai_model
    from tests.decoder_helpers import save_tiny

    root = tmp_path_factory.mktemp("tiny-genai-decoder")
    hf = save_tiny("llama", root / "hf")
    return hf, build_genai_model(hf, root / "v1", "fp32", threads=1)


def start_serving(project: Path, port: int, *extra: str):
    """Starts `pruneops serve` for `project` on loopback (stop it by terminating the process)."""
    import subprocess
    import sys

    cmd = [
        sys.executable,
        "-m",
        "pruneops.cli",
        "--root",
        str(project),
        "serve",
        "--port",
        str(port),
        "--registry",
        "models",
        *extra,
    ]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


@pytest.fixture
def served_project(tmp_path):
    """A registry with a trained digits model in production, and the reference statistics."""
    from pruneops.modelstore.store import ModelRegistry

    _, onnx_path, test = digits_onnx(tmp_path)
    registry = ModelRegistry(tmp_path / "models")
    registry.promote(registry.register(onnx_path, {"sparsity": 0.0}, version="v1").version)
    shutil.copy(ROOT / "params.yaml", tmp_path / "params.yaml")
    return tmp_path, test


LONG_TEST_S = 60.0  # a test longer than this says why in its marker: `@pytest.mark.slow(reason="...")`
_LONG: list[tuple[str, float, bool]] = []


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.when == "call" and report.duration > LONG_TEST_S:
        _LONG.append((report.nodeid, report.duration, bool(getattr(report, "slow_reason", ""))))


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call):
    outcome = yield
    marker = item.get_closest_marker("slow")
    outcome.get_result().slow_reason = marker.kwargs.get("reason", "") if marker else ""


def pytest_terminal_summary(terminalreporter) -> None:
    if not _LONG:
        return
    terminalreporter.section(f"tests over {LONG_TEST_S:.0f} s")
    for nodeid, seconds, has_reason in sorted(_LONG, key=lambda t: -t[1]):
        why = "" if has_reason else "  <- no reason in its slow marker"
        terminalreporter.write_line(f"{seconds:7.1f} s  {nodeid}{why}")
