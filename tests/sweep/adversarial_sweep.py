"""An adversarial sweep of every entry point, one bad input per case, tallied.

Entry points: params, data files (NPZ, CSV, image folders), checkpoints, exported and published
ONNX files, the model registry (races, faults, contract changes), HTTP bodies (arrays and base64
images), headers and slow clients, feedback, alert payloads and trigger timing, lineage (files DVC
would ignore), code named by overrides, monitoring thresholds, and a stage killed with SIGKILL.

python tests/sweep/adversarial_sweep.py [--workdir DIR]

Each case feeds one bad input and classifies the outcome:
- handled: a clear error (CLI: exit 1 or 2 and one `pruneops <cmd>: error:` line, no traceback;
  library: the project's own error type; HTTP: a 4xx with a message), and nothing written
  (no stage output, no temporary leftovers, production unchanged);
- internal: a traceback, an `internal error` line, a signal, a 5xx, or a foreign exception;
- silent: the bad input was accepted (exit 0 / 2xx / no error) where it must not be.
It prints one line per case and the totals; the exit code is the number of cases not handled.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
RESULTS: list[tuple[str, str, str, str]] = []
MAX_ERROR_LINE = 700  # an error line longer than this echoes input back


def record(entry: str, case: str, outcome: str, detail: str) -> None:
    RESULTS.append((entry, case, outcome, detail))
    print(f"{outcome:9} {entry:11} {case:44} {detail[:110]}", flush=True)


def cli(root: Path, stage: str, params: Path | None = None) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "pruneops.cli", "--root", str(root)]
    if params is not None:
        cmd += ["--params", str(params)]
    return subprocess.run([*cmd, stage], capture_output=True, text=True, timeout=900, cwd=root)


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    """Every file under the project's outputs, with size and modification time."""
    return {
        str(p): (p.stat().st_size, p.stat().st_mtime_ns)
        for d in ("artifacts", "metrics", "plots")
        for p in (root / d).rglob("*")
        if p.is_file()
    }


def run_and_classify(entry: str, case: str, root: Path, stage: str) -> None:
    before = snapshot(root)
    classify_cli(entry, case, root, cli(root, stage), stage, snapshot(root) != before)


def run_all(cases: list[tuple[str, str, Path, str]]) -> None:
    """`run_and_classify` for cases that each own their project folder, two CLI processes at a time.

    Each process mostly imports (torch, pandas): two at once take both cores of a 2-core machine,
    and the records keep the cases' order.
    """

    def run(item: tuple[str, str, Path, str]) -> tuple[subprocess.CompletedProcess, bool]:
        _, _, root, stage = item
        before = snapshot(root)
        result = cli(root, stage)
        return result, snapshot(root) != before

    assert len({root for _, _, root, _ in cases}) == len(cases), "cases share a project folder"
    with ThreadPoolExecutor(2) as pool:
        for (entry, case, root, stage), (result, wrote) in zip(cases, pool.map(run, cases), strict=True):
            classify_cli(entry, case, root, result, stage, wrote)


def classify_cli(
    entry: str, case: str, root: Path, result: subprocess.CompletedProcess, stage: str, wrote: bool
) -> None:
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    if result.returncode < 0 or "Traceback" in result.stderr or "internal error" in result.stderr:
        record(entry, case, "internal", f"exit {result.returncode}: {(lines or ['no output'])[-1]}")
    elif result.returncode == 0:
        record(entry, case, "silent", "accepted (exit 0)")
    elif wrote:
        record(entry, case, "silent", f"exit {result.returncode} but outputs written")
    elif lines and len(lines[0]) > MAX_ERROR_LINE:
        record(entry, case, "silent", f"exit {result.returncode}: an error line of {len(lines[0])} characters")
    elif lines and lines[0].startswith(f"pruneops {stage}: error: "):
        record(entry, case, "handled", f"exit {result.returncode}: {lines[0][len(stage) + 17 :]}")
    else:
        record(entry, case, "internal", f"exit {result.returncode}: {lines[:1]}")


def base_params() -> dict:
    params = yaml.safe_load((ROOT / "params.yaml").read_text())
    params["train"].update(epochs=2, model_kwargs={"widths": [8, 16]})
    return params


PARAM_CASES: list[tuple[str, str, Callable[[dict], object]]] = [
    ("train.threads 1000000", "train", lambda p: p["train"].update(threads=1_000_000)),
    ("train.epochs 10**12", "train", lambda p: p["train"].update(epochs=10**12)),
    ("train.batch_size 0", "train", lambda p: p["train"].update(batch_size=0)),
    ("train.lr nan", "train", lambda p: p["train"].update(lr=float("nan"))),
    ("train.lr inf", "train", lambda p: p["train"].update(lr=float("inf"))),
    ("train.seed -5", "train", lambda p: p["train"].update(seed=-5)),
    ("train.epochs '3' (string)", "train", lambda p: p["train"].update(epochs="3")),
    ("train.epochs true (bool)", "train", lambda p: p["train"].update(epochs=True)),
    ("train.model unknown", "train", lambda p: p["train"].update(model="resnet999")),
    ("train.model import path missing", "train", lambda p: p["train"].update(model="nopkg.mod:build")),
    ("train.model_kwargs widths 10**9", "train", lambda p: p["train"].update(model_kwargs={"widths": [10**9]})),
    ("train.model_kwargs unknown kwarg", "train", lambda p: p["train"].update(model_kwargs={"colour": "red"})),
    ("validate.value_range [-inf, inf]", "validate", lambda p: p["validate"].update(value_range=[-1e400, 1e400])),
    ("validate.value_range [1, 0]", "validate", lambda p: p["validate"].update(value_range=[1.0, 0.0])),
    ("validate.classes [10**12]", "validate", lambda p: p["validate"].update(classes=[0, 10**12])),
    ("validate.path with NUL byte", "validate", lambda p: p["validate"].update(dataset="npz", path="a\x00b.npz")),
    ("validate.dataset unknown", "validate", lambda p: p["validate"].update(dataset="imagenet")),
    ("validate.val_fraction 1.0", "validate", lambda p: p["validate"].update(val_fraction=1.0)),
    ("export.parity_atol inf", "validate", lambda p: p["export"].update(parity_atol=float("inf"))),
    ("quantize.method unknown", "validate", lambda p: p["quantize"].update(method="fp4")),
    ("prune.scope for channel", "validate", lambda p: p["prune"].update(scope="layer")),
    ("prune.target.value 1e400", "validate", lambda p: p["prune"].update(target_value=1e400)),
    (
        "prune.importance taylor on magnitude",
        "validate",
        lambda p: p["prune"].update(method="magnitude", importance="taylor"),
    ),
    ("benchmark.batch_sizes []", "validate", lambda p: p["benchmark"].update(batch_sizes=[])),
    ("benchmark.batch_sizes [10**9]", "validate", lambda p: p["benchmark"].update(batch_sizes=[10**9])),
    ("serve.reload_interval_s 0", "validate", lambda p: p["serve"].update(reload_interval_s=0)),
    ("reprune.drift_check_cron garbage", "validate", lambda p: p["reprune"].update(drift_check_cron="every day")),
    ("a section that is a list", "validate", lambda p: p.update(prune=[1, 2])),
    ("an unknown section", "validate", lambda p: p.update(prunee={})),
    ("key with newline and non-ASCII", "validate", lambda p: p["train"].update({"ép\noch": 1})),
    ("missing train section", "train", lambda p: p.pop("train")),
    (
        "train.preprocess channels 3 -> 1",
        "train",
        lambda p: p["train"].update(preprocess={"channels": 1, "mean": [0.5] * 3}),
    ),
    ("train.preprocess std 0", "train", lambda p: p["train"].update(preprocess={"std": [0.0]})),
    ("train.preprocess resize [10**9, 1]", "train", lambda p: p["train"].update(preprocess={"resize": [10**9, 1]})),
    ("train.preprocess unknown key", "train", lambda p: p["train"].update(preprocess={"rotate": 90})),
    (
        "train.preprocess on 8x8 mean of 5",
        "train",
        lambda p: p["train"].update(preprocess={"channels": 3, "mean": [0.1] * 5}),
    ),
    ("train.init_weights missing file", "train", lambda p: p["train"].update(init_weights="nope.pth")),
    ("train.epochs 0 without weights", "train", lambda p: p["train"].update(epochs=0)),
    ("validate.max_class_imbalance 0.5", "validate", lambda p: p["validate"].update(max_class_imbalance=0.5)),
    ("validate image_folder without path", "validate", lambda p: p["validate"].update(dataset="image_folder")),
    ("an empty train section", "train", lambda p: p.update(train=None)),
    ("train.epochs a 10,000-item list", "train", lambda p: p["train"].update(epochs=list(range(10_000)))),
]

RAW_PARAM_FILES: list[tuple[str, bytes]] = [
    ("empty params file", b""),
    ("truncated YAML", b"train:\n  epochs: [1, 2\n"),
    ("non-UTF-8 bytes", b"train:\n  model: \xff\xfe\x00\n"),
    ("a YAML list", b"- 1\n- 2\n"),
    ("a directory", b""),
]


def sweep_params(work: Path, pipeline: Path) -> None:
    cases = []
    for case, stage, mutate in PARAM_CASES:
        root = Path(tempfile.mkdtemp(dir=work))
        shutil.copytree(pipeline / "artifacts/validate", root / "artifacts/validate")  # what train reads
        params = base_params()
        mutate(params)
        (root / "params.yaml").write_text(yaml.safe_dump(params, allow_unicode=True))
        cases.append(("params", case, root, stage))
    for case, content in RAW_PARAM_FILES:
        root = Path(tempfile.mkdtemp(dir=work))
        if case == "a directory":
            (root / "params.yaml").mkdir()
        else:
            (root / "params.yaml").write_bytes(content)
        cases.append(("params", case, root, "validate"))
    run_all(cases)


def _npz(**arrays) -> bytes:
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    return buffer.getvalue()


def _images(n: int, dtype="uint8") -> np.ndarray:
    return np.random.default_rng(0).integers(0, 255, (n, 8, 8)).astype(dtype)


GOOD = {"x_train": _images(200), "y_train": np.arange(200) % 4, "x_test": _images(40), "y_test": np.arange(40) % 4}
DATA_CASES: list[tuple[str, str, bytes]] = [
    ("npz: random bytes", "npz", os.urandom(500)),
    ("npz: truncated archive", "npz", _npz(**GOOD)[:3000]),
    ("npz: missing y_test", "npz", _npz(**{k: v for k, v in GOOD.items() if k != "y_test"})),
    ("npz: labels 1.5 (float)", "npz", _npz(**{**GOOD, "y_train": np.full(200, 1.5)})),
    ("npz: labels -1", "npz", _npz(**{**GOOD, "y_train": np.full(200, -1)})),
    ("npz: labels 2**40", "npz", _npz(**{**GOOD, "y_train": np.full(200, 2**40)})),
    ("npz: labels as strings", "npz", _npz(**{**GOOD, "y_train": np.array(["a"] * 200)})),
    ("npz: complex inputs", "npz", _npz(**{**GOOD, "x_train": _images(200).astype(np.complex64)})),
    ("npz: NaN in inputs", "npz", _npz(**{**GOOD, "x_train": np.where(_images(200) > 250, np.nan, 1.0)})),
    ("npz: 1e30 in float32 inputs", "npz", _npz(**{**GOOD, "x_train": np.full((200, 8, 8), 1e30, np.float32)})),
    ("npz: scalar y_train", "npz", _npz(**{**GOOD, "y_train": np.array(3)})),
    (
        "npz: empty arrays",
        "npz",
        _npz(x_train=np.zeros((0, 8, 8)), y_train=np.zeros(0), x_test=np.zeros((0, 8, 8)), y_test=np.zeros(0)),
    ),
    ("npz: lengths disagree", "npz", _npz(**{**GOOD, "y_train": np.arange(150) % 4})),
    ("npz: train/test shapes disagree", "npz", _npz(**{**GOOD, "x_test": _images(40)[:, :4]})),
    ("npz: 3 samples", "npz", _npz(x_train=_images(3), y_train=np.arange(3), x_test=_images(2), y_test=np.arange(2))),
    (
        "npz: all test in train (leakage)",
        "npz",
        _npz(**{**GOOD, "x_test": GOOD["x_train"][:40], "y_test": GOOD["y_train"][:40]}),
    ),
    ("csv: text in a feature column", "table", b"label,a,b\n" + b"0,1,2\n1,x,3\n" * 20),
    ("csv: string labels", "table", b"label,a\n" + b"cat,1\ndog,2\n" * 20),
    ("csv: empty labels", "table", b"label,a\n" + b",1\n1,2\n" * 20),
    ("csv: header only", "table", b"label,a,b\n"),
    ("csv: non-UTF-8 bytes", "table", b"label,a\n" + b"0,\xff\xfe\n1,2\n" * 10),
    ("csv: one row", "table", b"label,a\n0,1\n"),
    ("csv: no label column", "table", b"a,b\n" + b"1,2\n3,4\n" * 10),
    ("csv: inf values", "table", b"label,a\n" + b"0,inf\n1,-inf\n" * 20),
    ("csv: one class only", "table", b"label,a\n" + b"0,1\n0,2\n" * 20),
    ("csv: a column named twice", "table", b"label,a,a\n" + b"0,1,2\n1,2,3\n" * 20),
    ("npz: an array declaring 10**6 x 10**6", "npz", b""),  # written by _huge_npz
]


def _huge_npz() -> bytes:
    """GOOD with x_train's header declaring (10**6, 10**6) over 12,800 bytes of data."""
    import zipfile

    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        for name, array in GOOD.items():
            member = io.BytesIO()
            np.save(member, array)
            raw = member.getvalue()
            if name == "x_train":
                declared = str(tuple(array.shape)).encode()
                raw = raw.replace(declared, b"(1000000, 1000000)".ljust(len(declared)))
            archive.writestr(f"{name}.npy", raw)
    return out.getvalue()


def sweep_data(work: Path) -> None:
    cases = []
    for case, kind, content in DATA_CASES:
        root = Path(tempfile.mkdtemp(dir=work))
        data = root / ("data.npz" if kind == "npz" else "data.csv")
        data.write_bytes(content or _huge_npz())
        params = base_params()
        params["validate"].update(dataset=kind, path=str(data))
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        cases.append(("data", case, root, "validate"))
    run_all(cases)


def _png(pixels: np.ndarray, fmt: str = "PNG") -> bytes:
    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8)).save(buffer, format=fmt)
    return buffer.getvalue()


def _image_folder_cases() -> list[tuple[str, dict[str, bytes]]]:
    from tests.conftest import png_bomb

    good = {f"{c}/{i}.png": _png(_images(1)[0]) for c in ("a", "b") for i in range(3)}
    return [
        ("image_folder: no class folders", {"readme.txt": b"hi"}),
        ("image_folder: a text file among images", {**good, "a/notes.txt": b"hi"}),
        ("image_folder: truncated PNG", {**good, "a/9.png": good["a/0.png"][:40]}),
        ("image_folder: garbage named .jpg", {**good, "b/9.jpg": b"\xff\xd8 not a jpeg"}),
        ("image_folder: sizes differ", {**good, "b/9.png": _png(np.zeros((5, 7)))}),
        ("image_folder: decompression bomb", {**good, "a/9.png": png_bomb()}),
        ("image_folder: an empty class folder", {**good, "c/.keep": b""}),
        (
            "image_folder: test class unknown to train",
            {**{f"train/{k}": v for k, v in good.items()}, "test/zebra/0.png": good["a/0.png"]},
        ),
        ("image_folder: one image per class", {"a/0.png": good["a/0.png"], "b/0.png": good["b/0.png"]}),
    ]


def sweep_image_folders(work: Path) -> None:
    cases = []
    for case, files in _image_folder_cases():
        root = Path(tempfile.mkdtemp(dir=work))
        for name, data in files.items():
            (root / "images" / name).parent.mkdir(parents=True, exist_ok=True)
            (root / "images" / name).write_bytes(data)
        params = base_params()
        params["validate"].update(dataset="image_folder", path=str(root / "images"))
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        cases.append(("data", case, root, "validate"))
    run_all(cases)


def _pipeline(work: Path) -> Path:
    root = work / "pipeline"
    root.mkdir()
    (root / "params.yaml").write_text(yaml.safe_dump(base_params()))
    for stage in ("validate", "train"):
        assert cli(root, stage).returncode == 0, stage
    return root


def _pipeline_copy(work: Path, pipeline: Path) -> Path:
    """A scratch copy of the pipeline's artefacts and params (each case damages its own)."""
    root = Path(tempfile.mkdtemp(dir=work))
    for part in ("artifacts", "params.yaml"):
        src = pipeline / part
        shutil.copytree(src, root / part) if src.is_dir() else shutil.copy(src, root / part)
    return root


def sweep_checkpoints(work: Path, pipeline: Path) -> None:
    def flip(path: Path, n: int) -> None:
        data = bytearray(path.read_bytes())
        for i in range(len(data) - n, len(data)):
            data[i] ^= 0x5A
        path.write_bytes(bytes(data))

    cases: list[tuple[str, Callable[[Path], None]]] = [
        ("2,000 flipped bytes, header intact", lambda p: flip(p, 2000)),
        ("one flipped byte", lambda p: flip(p, 1)),
        ("truncated to half", lambda p: p.write_bytes(p.read_bytes()[: p.stat().st_size // 2])),
        ("empty file", lambda p: p.write_bytes(b"")),
        ("random bytes", lambda p: p.write_bytes(os.urandom(4096))),
        ("checksum file removed", lambda p: Path(f"{p}.sha256").unlink()),
        ("checksum file edited", lambda p: Path(f"{p}.sha256").write_text("0" * 64)),
        ("untrained weights, valid checksum", _untrained),
        ("another project's checkpoint, valid checksum", _other_project),
    ]
    runs = []
    for case, damage in cases:
        root = _pipeline_copy(work, pipeline)
        damage(root / "artifacts/train/model.safetensors")
        runs.append(("checkpoint", case, root, "sensitivity"))
    run_all(runs)


def sweep_prepared_splits(work: Path, pipeline: Path) -> None:
    """A prepared split (validate's output) damaged after the fact: the next stage names the file."""
    cases: list[tuple[str, Callable[[Path], None]]] = [
        ("val.npz emptied", lambda p: p.write_bytes(b"")),
        ("val.npz declaring 10**6 x 10**6", lambda p: p.write_bytes(_huge_npz())),
        ("val.npz random bytes", lambda p: p.write_bytes(os.urandom(2048))),
    ]
    runs = []
    for case, damage in cases:
        root = _pipeline_copy(work, pipeline)
        damage(root / "artifacts/validate/val.npz")
        runs.append(("data", case, root, "sensitivity"))
    run_all(runs)


def _other_project(path: Path) -> None:
    """A checkpoint of the same architecture built for other inputs and classes, saved with its checksum."""
    from dataclasses import replace

    from pruneops.models import create_model
    from pruneops.models.checkpoint import load_checkpoint, save_checkpoint

    trained = load_checkpoint(path)
    other = replace(trained.spec, input_shape=[trained.spec.input_shape[0], 12, 12], num_classes=3)
    save_checkpoint(path, create_model(other), other, trained.extra)


def _untrained(path: Path) -> None:
    from pruneops.models import create_model
    from pruneops.models.checkpoint import load_checkpoint, save_checkpoint

    trained = load_checkpoint(path)
    save_checkpoint(path, create_model(trained.spec), trained.spec, trained.extra)


def sweep_registry(work: Path) -> None:
    from pruneops.core.errors import PruneOpsError
    from pruneops.modelstore.store import ModelRegistry
    from tests.conftest import tiny_onnx

    def nan_model(path: Path) -> None:
        import onnx
        from onnx import numpy_helper

        tiny_onnx(path, 1)
        model = onnx.load(str(path))
        model.graph.initializer[0].CopyFrom(numpy_helper.from_array(np.full((4, 3), np.nan, np.float32), "W"))
        onnx.save(model, str(path))

    cases: list[tuple[str, Callable[[Path], None], str | None]] = [
        ("junk bytes as model.onnx", lambda p: p.write_bytes(b"junk"), None),
        ("empty model.onnx", lambda p: p.write_bytes(b""), None),
        ("model whose logits are NaN", nan_model, None),
        ("reference stats: truncated JSON", lambda p: tiny_onnx(p, 2), '{"bin_edges": [0,'),
        (
            "reference stats: wrong shapes",
            lambda p: tiny_onnx(p, 2),
            json.dumps(
                {
                    "bin_edges": [0, 0.5, 1],
                    "histograms": [[1.0]],
                    "quantile_levels": [0, 1],
                    "quantiles": [[0, 1]],
                    "classes": [0],
                    "class_frequencies": [1],
                    "feature_groups": {"a": [0]},
                }
            ),
        ),
        (
            "reference stats: NaN histogram",
            lambda p: tiny_onnx(p, 2),
            json.dumps(
                {
                    "bin_edges": [0, 1],
                    "histograms": [[float("nan")]] * 4,
                    "quantile_levels": [0, 1],
                    "quantiles": [[0, 1]] * 4,
                    "classes": [0, 1, 2],
                    "class_frequencies": [0.3, 0.3, 0.4],
                    "feature_groups": {"a": [0]},
                }
            ).replace("NaN", "NaN"),
        ),
    ]
    for case, make, reference in cases:
        root = Path(tempfile.mkdtemp(dir=work))
        registry = ModelRegistry(root / "models")
        registry.promote(registry.register(tiny_onnx(root / "good.onnx", 0), {}, version="good").version)
        make(root / "bad.onnx")
        ref = None
        if reference is not None:
            ref = root / "ref.json"
            ref.write_text(reference)
        registry.register(root / "bad.onnx", {}, version="bad", reference_stats=ref)
        try:
            registry.promote("bad")
            record("registry", case, "silent", "promoted")
        except PruneOpsError as exc:
            ok = registry.production().version == "good"
            record("registry", case, "handled" if ok else "silent", str(exc)[-100:])
        except Exception as exc:  # noqa: BLE001
            record("registry", case, "internal", f"{type(exc).__name__}: {exc}")


def _serving(work: Path):
    from fastapi.testclient import TestClient

    from pruneops.modelstore.store import ModelRegistry
    from pruneops.serving.app import ServingConfig, create_app
    from tests.conftest import digits_onnx

    root = Path(tempfile.mkdtemp(dir=work))
    data_dir, onnx_path, test = digits_onnx(root)
    registry = ModelRegistry(root / "models")
    described = {"input": {"input_shape": [1, 8, 8], "value_range": [0.0, 16.0], "class_names": None}}
    registry.promote(registry.register(onnx_path, described, version="v1").version)
    config = ServingConfig(
        production=root / "models/production",
        reference_stats=data_dir / "reference_stats.json",
        feedback_path=root / "feedback.npz",
        feedback_flush_every=1,
        reload_interval_s=3600,
    )
    return TestClient(create_app(config), raise_server_exceptions=False), test


def sweep_http(work: Path) -> None:
    client, test = _serving(work)
    with client:
        x = test.x[:1].tolist()
        ok = client.post("/predict", json={"inputs": x}).json()["prediction_ids"][0]
        big = b'{"inputs": [' + b"0.5," * 12_000_000 + b"0.5]}"
        cases: list[tuple[str, str, dict]] = [
            ("48 MB JSON body", "/predict", {"content": big}),
            (
                "48 MB chunked body",
                "/predict",
                {"content": (big[i : i + 1 << 20] for i in range(0, len(big), 1 << 20))},
            ),
            ("invalid JSON", "/predict", {"content": b'{"inputs": [1,'}),
            ("empty body", "/predict", {"content": b""}),
            ("inputs: string", "/predict", {"json": {"inputs": "abc"}}),
            ("inputs: ragged", "/predict", {"json": {"inputs": [[1, 2], [3]]}}),
            ("inputs: wrong shape", "/predict", {"json": {"inputs": [[0.1, 0.2]]}}),
            ("inputs: NaN", "/predict", {"content": b'{"inputs": [[[[NaN,0,0,0,0,0,0,0]]]]}'}),
            (
                "inputs: 1e400 (overflows float32)",
                "/predict",
                {"content": b'{"inputs": [[' + b"[1e400,0,0,0,0,0,0,0]," * 7 + b"[0,0,0,0,0,0,0,0]]]}"},
            ),
            (
                "inputs: 10**400 integer",
                "/predict",
                {"content": b'{"inputs": [[' + b"[1" + b"0" * 400 + b",0,0,0,0,0,0,0]," * 7 + b"[0,0,0,0,0,0,0,0]]]}"},
            ),
            ("inputs: booleans", "/predict", {"json": {"inputs": [[[[True] * 8] * 8]]}}),
            ("inputs: nested 5,000 deep", "/predict", {"content": b'{"inputs": ' + b"[" * 5000 + b"]" * 5000 + b"}"}),
            ("inputs: batch of 10,000", "/predict", {"json": {"inputs": [x[0]] * 10_000}}),
            ("inputs: non-ASCII text", "/predict", {"json": {"inputs": [["ünïcödé ☃"]]}}),
            ("wrong content-type", "/predict", {"content": b"inputs=1", "headers": {"content-type": "text/plain"}}),
            ("images: not base64", "/predict", {"json": {"images": ["%%%"]}}),
            ("images: base64 of text", "/predict", {"json": {"images": ["aGVsbG8gd29ybGQ="]}}),
            ("images: truncated PNG", "/predict", {"json": {"images": [_b64(_png(np.zeros((8, 8)))[:30])]}}),
            ("images: decompression bomb", "/predict", {"json": {"images": [_b64(_bomb())]}}),
            ("images: numbers", "/predict", {"json": {"images": [1, 2]}}),
            ("images: a string, not a list", "/predict", {"json": {"images": "abc"}}),
            ("images: empty list", "/predict", {"json": {"images": []}}),
            ("images: 10,000 of them", "/predict", {"json": {"images": [_b64(_png(np.zeros((8, 8))))] * 10_000}}),
            (
                "images and inputs together",
                "/predict",
                {"json": {"images": [_b64(_png(np.zeros((8, 8))))], "inputs": x}},
            ),
            ("feedback: label 10**30", "/feedback", {"json": {"prediction_id": ok, "label": 10**30}}),
            ("feedback: label -1", "/feedback", {"json": {"prediction_id": ok, "label": -1}}),
            ("feedback: label 1.5", "/feedback", {"json": {"prediction_id": ok, "label": 1.5}}),
            ("feedback: label 'seven'", "/feedback", {"json": {"prediction_id": ok, "label": "seven"}}),
            ("feedback: unknown id", "/feedback", {"json": {"prediction_id": "nope", "label": 1}}),
            ("feedback: 10 KB id", "/feedback", {"json": {"prediction_id": "x" * 10_000, "label": 1}}),
        ]
        for case, path, kwargs in cases:
            _http_case(client, "http", case, path, kwargs)
        # A valid request with an odd header must simply work (it used to be a 500).
        odd = client.post("/predict", json={"inputs": x}, headers={"x-custom": b"caf\xe9\xff"})
        record(
            "http",
            "valid body, non-ASCII header bytes",
            "handled" if odd.status_code == 200 else "internal",
            str(odd.status_code),
        )
        after = client.post("/feedback", json={"prediction_id": ok, "label": 3})
        record(
            "http",
            "feedback still works after all that",
            "handled" if after.status_code == 200 else "internal",
            str(after.status_code),
        )


def _b64(data: bytes) -> str:
    import base64

    return base64.b64encode(data).decode()


def _bomb() -> bytes:
    from tests.conftest import png_bomb

    return png_bomb()


def _http_case(client, entry: str, case: str, path: str, kwargs: dict) -> None:
    started = time.perf_counter()
    try:
        r = client.post(path, **kwargs)
    except Exception as exc:  # noqa: BLE001
        record(entry, case, "internal", f"{type(exc).__name__}: {str(exc)[:80]}")
        return
    took = time.perf_counter() - started
    if r.status_code >= 500:
        record(entry, case, "internal", f"{r.status_code} {r.text[:80]}")
    elif r.status_code < 400:
        record(entry, case, "silent", f"{r.status_code} accepted")
    elif len(r.content) > MAX_ERROR_LINE:
        record(entry, case, "silent", f"{r.status_code} with a {len(r.content)}-byte answer (echoes input)")
    else:
        record(entry, case, "handled", f"{r.status_code} in {took:.2f}s: {r.text[:70]}")


def sweep_receiver() -> None:
    from fastapi.testclient import TestClient

    from pruneops.serving.receiver import create_receiver

    def trigger(alert: dict) -> str:
        if alert.get("fingerprint") == "fail":
            raise ConnectionError("Prefect API unreachable")
        return "run-1"

    client = TestClient(create_receiver("s3cret", trigger, cooldown_s=0), raise_server_exceptions=False)
    auth = {"Authorization": "Bearer s3cret"}
    alert = {"status": "firing", "fingerprint": "a", "labels": {"alertname": "x"}}
    cases: list[tuple[str, str, dict]] = [
        ("no Authorization header", "/alerts", {"json": {"alerts": [alert]}}),
        ("wrong token", "/alerts", {"json": {"alerts": [alert]}, "headers": {"Authorization": "Bearer nope"}}),
        (
            "Basic instead of Bearer",
            "/alerts",
            {"json": {"alerts": [alert]}, "headers": {"Authorization": "Basic czNjcmV0"}},
        ),
        (
            "non-ASCII header bytes",
            "/alerts",
            {"json": {"alerts": [alert]}, "headers": {"Authorization": b"Bearer s3cr\xe9t\xff"}},
        ),
        ("GET /decisions without token", "/decisions", {}),
        ("payload: not JSON", "/alerts", {"content": b"{", "headers": auth}),
        ("payload: alerts is a string", "/alerts", {"json": {"alerts": "x"}, "headers": auth}),
        ("payload: alerts missing", "/alerts", {"json": {"status": "firing"}, "headers": auth}),
        (
            "payload: labels not strings",
            "/alerts",
            {"json": {"alerts": [{**alert, "labels": {"a": [1]}}]}, "headers": auth},
        ),
        ("payload: 100,000 alerts", "/alerts", {"json": {"alerts": [alert] * 100_000}, "headers": auth}),
        (
            "payload: 10 KB fingerprint",
            "/alerts",
            {"json": {"alerts": [{**alert, "fingerprint": "f" * 10_000}]}, "headers": auth},
        ),
        (
            "trigger unconfirmed (Prefect down)",
            "/alerts",
            {"json": {"alerts": [{**alert, "fingerprint": "fail"}]}, "headers": auth},
        ),
        ("payload: 5 MB body", "/alerts", {"content": b" " * 5_000_000, "headers": auth}),
    ]
    for case, path, kwargs in cases:
        if path == "/decisions":
            r = client.get(path)
            outcome = "handled" if r.status_code == 401 else "silent"
            record("receiver", case, outcome, str(r.status_code))
        elif case.startswith("trigger unconfirmed"):
            r = client.post(path, **kwargs)
            outcome = "handled" if r.status_code == 503 else ("internal" if r.status_code >= 500 else "silent")
            record("receiver", case, outcome, f"{r.status_code} (5xx expected: Alertmanager retries)")
        else:
            _http_case(client, "receiver", case, path, kwargs)


def _wait_for_line(proc: subprocess.Popen, marker: str, timeout_s: float) -> bool:
    """Read the process's stderr until a line holds `marker` (True), it exits or `timeout_s` passes (False)."""
    deadline = time.monotonic() + timeout_s
    found: list[bool] = []

    def read() -> None:
        for line in proc.stderr:
            if marker in line:
                found.append(True)
                return

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(max(deadline - time.monotonic(), 0.0))
    return bool(found)


def sweep_kill(work: Path, pipeline: Path) -> None:
    """SIGKILL a stage mid-run: the previous outputs stay, the next run sweeps the leftovers and works."""
    root = Path(tempfile.mkdtemp(dir=work))
    for part in ("artifacts", "params.yaml"):
        src = pipeline / part
        shutil.copytree(src, root / part) if src.is_dir() else shutil.copy(src, root / part)
    params = base_params()
    # As many epochs as the config allows: the kill lands mid-training however fast the machine is.
    params["train"].update(epochs=10_000, patience=10_000)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    before = (root / "artifacts/train/model.safetensors").read_bytes()
    proc = subprocess.Popen(
        [sys.executable, "-m", "pruneops.cli", "--root", str(root), "train"],
        cwd=root,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    training = _wait_for_line(proc, "train epoch 2/", timeout_s=120.0)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    intact = (root / "artifacts/train/model.safetensors").read_bytes() == before
    left = list((root / "artifacts").glob(".*tmp*"))
    record(
        "kill -9",
        "train killed mid-epoch: previous model intact",
        "handled" if intact and training else "silent",
        f"{len(left)} twin(s) left" if training else "no second epoch logged within 120 s",
    )
    params["train"].update(epochs=1, patience=1)
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    rerun = cli(root, "train")
    swept = not list((root / "artifacts").glob(".*tmp*"))
    ok = rerun.returncode == 0 and swept
    record(
        "kill -9",
        "next run sweeps the leftovers and succeeds",
        "handled" if ok else "silent",
        f"exit {rerun.returncode}, swept {swept}",
    )


# --- Reliability, round two: integrity, the registry under faults, feedback, lineage, code by name ---


def _exported(work: Path) -> Path:
    """A project where every stage ran on digits with tiny settings (the tests' `pipeline_dir`)."""
    from tests.conftest import tiny_params, write_params

    root = work / "exported"
    root.mkdir()
    write_params(root, tiny_params())
    for stage in ("validate", "train", "sensitivity", "latency", "prune", "finetune", "quantize", "export"):
        assert cli(root, stage).returncode == 0, stage
    return root


def _copy_project(src: Path, work: Path) -> Path:
    root = Path(tempfile.mkdtemp(dir=work))
    for part in ("artifacts", "metrics", "params.yaml"):
        if (src / part).is_dir():
            shutil.copytree(src / part, root / part)
        elif (src / part).exists():
            shutil.copy(src / part, root / part)
    return root


def _flip(path: Path, n: int) -> None:
    data = bytearray(path.read_bytes())
    for i in range(max(len(data) - n, 0), len(data)):
        data[i] ^= 0x5A
    path.write_bytes(bytes(data))


def sweep_artifacts(work: Path, exported: Path) -> None:
    """A served or published file changed on disk: benchmark and publish refuse it, nothing is registered."""
    deployed = "artifacts/export/pruned_deployed.onnx"
    cases: list[tuple[str, Callable[[Path], None]]] = [
        ("2,000 flipped bytes in the deployed ONNX", lambda r: _flip(r / deployed, 2000)),
        ("one flipped byte in the dense ONNX", lambda r: _flip(r / "artifacts/export/dense_fp32.onnx", 1)),
        ("deployed ONNX truncated", lambda r: (r / deployed).write_bytes((r / deployed).read_bytes()[:500])),
        ("deployed checksum removed", lambda r: Path(f"{r / deployed}.sha256").unlink()),
    ]
    for case, damage in cases:
        for command in ("benchmark", "publish"):
            root = _copy_project(exported, work)
            damage(root)
            before = snapshot(root)
            result = cli(root, command)
            registered = (root / "models/candidates").exists() and any((root / "models/candidates").iterdir())
            wrote = snapshot(root) != before or registered
            intact = (command == "publish" and "dense" in case) or (command == "benchmark" and "removed" in case)
            if intact:  # publish reads the deployed model only; benchmark checks the manifest's digests
                ok = result.returncode == 0
                record(
                    "artifacts",
                    f"{case}: {command} (file intact)",
                    "handled" if ok else "silent",
                    f"exit {result.returncode}",
                )
                continue
            classify_cli("artifacts", f"{case}: {command}", root, result, command, wrote)


def _registry_with(work: Path, *versions: tuple[str, int, int]):
    from pruneops.modelstore.store import ModelRegistry
    from tests.conftest import tiny_onnx

    root = Path(tempfile.mkdtemp(dir=work))
    registry = ModelRegistry(root / "models")
    for name, seed, features in versions:
        registry.register(tiny_onnx(root / f"{name}.onnx", seed, features=features), {}, version=name)
    return registry


def _production_is(registry, version: str) -> bool:
    linked = Path(os.readlink(registry.production_link)).name if registry.production_link.is_symlink() else None
    return registry.production().version == version == linked


def _expect_refusal(entry: str, case: str, action: Callable[[], object], intact: Callable[[], bool]) -> None:
    from pruneops.core.errors import PruneOpsError

    try:
        action()
        record(entry, case, "silent", "accepted")
    except PruneOpsError as exc:
        record(entry, case, "handled" if intact() else "silent", str(exc)[:100])
    except Exception as exc:  # noqa: BLE001
        record(entry, case, "internal", f"{type(exc).__name__}: {str(exc)[:80]}")


def sweep_registry_faults(work: Path) -> None:
    """Races, contract changes, unreadable metadata and history, a full disk, a lagging symlink."""
    race = subprocess.run(
        [sys.executable, str(ROOT / "tests/sweep/registry_race.py"), "--repetitions", "3", "--operations", "100"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    tally = race.stdout.strip().splitlines()[-1] if race.stdout.strip() else race.stderr[-100:]
    record("registry", "2 processes x 100 operations, 3 races", "handled" if race.returncode == 0 else "silent", tally)

    registry = _registry_with(work, ("v1", 1, 4), ("wide", 2, 64))
    registry.promote("v1")
    _expect_refusal(
        "registry",
        "promote a model with another input shape",
        lambda: registry.promote("wide"),
        lambda: _production_is(registry, "v1"),
    )

    registry = _registry_with(work, ("v1", 1, 4), ("v2", 2, 4))
    registry.promote("v1")
    registry.promote("v2")
    (registry.get("v1").path / "metadata.json").write_text("{corrupt")
    _expect_refusal(
        "registry", "rollback onto corrupt metadata", registry.rollback, lambda: _production_is(registry, "v2")
    )

    registry = _registry_with(work, ("v1", 1, 4), ("v2", 2, 4))
    registry.promote("v1")
    _flip(registry.get("v2").model_file, 200)
    _expect_refusal(
        "registry",
        "promote a candidate whose ONNX changed",
        lambda: registry.promote("v2"),
        lambda: _production_is(registry, "v1"),
    )

    registry = _registry_with(work, ("v1", 1, 4), ("v2", 2, 4))
    registry.promote("v1")
    real_replace = os.replace

    def full_disk(src, dst):
        if Path(dst).name == "history.json":
            raise OSError(28, "No space left on device")
        return real_replace(src, dst)

    os.replace = full_disk
    try:
        _expect_refusal(
            "registry", "promote on a full disk", lambda: registry.promote("v2"), lambda: _production_is(registry, "v1")
        )
    finally:
        os.replace = real_replace

    registry = _registry_with(work, ("v1", 1, 4), ("v2", 2, 4))
    registry.promote("v1")
    registry.promote("v2")
    registry.history_file.write_text('[{"action": "prom')
    _expect_refusal("registry", "operation on an unreadable history", lambda: registry.promote("v1"), lambda: True)
    try:
        done = registry.recover()
        ok = done["production"] == "v2" and _production_is(registry, "v2")
        record("registry", "recover rebuilds it from the candidates", "handled" if ok else "silent", json.dumps(done))
    except Exception as exc:  # noqa: BLE001
        record("registry", "recover rebuilds it from the candidates", "internal", f"{type(exc).__name__}: {exc}")

    registry = _registry_with(work, ("v1", 1, 4), ("v2", 2, 4))
    registry.promote("v1")
    registry.promote("v2")
    os.symlink("candidates/v1", registry.root / ".stale")
    os.replace(registry.root / ".stale", registry.production_link)
    registry.promote("v1")
    ok = registry.served_stack() == ["v1", "v2", "v1"] and _production_is(registry, "v1")
    record("registry", "a symlink that lags history", "handled" if ok else "silent", str(registry.served_stack()))


def sweep_feedback_and_startup(work: Path) -> None:
    """Replayed and non-integer labels, deep nesting, a restart onto a changed model file."""
    client, test = _serving(work)
    with client:
        x = test.x[:1].tolist()
        pid = client.post("/predict", json={"inputs": x}).json()["prediction_ids"][0]
        first = client.post("/feedback", json={"prediction_id": pid, "label": int(test.y[0])})
        replays = [client.post("/feedback", json={"prediction_id": pid, "label": 9}).status_code for _ in range(200)]
        ok = first.status_code == 200 and set(replays) == {409}
        record("feedback", "one id labelled 200 more times", "handled" if ok else "silent", f"{set(replays)}")
        pid = client.post("/predict", json={"inputs": x}).json()["prediction_ids"][0]
        for case, label in (("label true", True), ("label 1.0", 1.0), ("label null", None)):
            _http_case(client, "feedback", case, "/feedback", {"json": {"prediction_id": pid, "label": label}})
        for depth in (33, 40, 64):
            body = b'{"inputs": ' + b"[" * depth + b"1" + b"]" * depth + b"}"
            _http_case(
                client,
                "http",
                f"inputs nested {depth} deep",
                "/predict",
                {"content": body, "headers": {"content-type": "application/json"}},
            )
    from pruneops.modelstore.store import ModelRegistry
    from pruneops.serving.app import ServingConfig, create_app
    from tests.conftest import tiny_onnx

    root = Path(tempfile.mkdtemp(dir=work))
    registry = ModelRegistry(root / "models")
    for n in (1, 2):
        registry.promote(registry.register(tiny_onnx(root / f"m{n}.onnx", n), {}, version=f"v{n}").version)
    _flip(registry.get("v2").model_file, 100)
    from fastapi.testclient import TestClient

    with TestClient(create_app(ServingConfig(production=registry.production_link, reference_stats=None))) as c:
        served = c.get("/readyz").json().get("model_version")
    ok = served != "v2"
    record("serving", "restart onto a production ONNX that changed", "handled" if ok else "silent", f"serves {served}")


def sweep_slow_clients() -> None:
    """Half-open connections against a real server with a read deadline."""
    import socket
    import threading

    import uvicorn

    from pruneops.serving.limits import read_timeout_protocol
    from pruneops.serving.receiver import create_receiver
    from tests.conftest import free_port, wait_http

    port = free_port()
    config = uvicorn.Config(
        create_receiver("t", lambda a: "run"),
        host="127.0.0.1",
        port=port,
        log_level="error",
        http=read_timeout_protocol(1.0),
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    wait_http(f"http://127.0.0.1:{port}/healthz")
    kinds = {
        "200 connections sending nothing": b"",
        "200 connections with half their headers": b"POST /alerts HTTP/1.1\\r\\nHost: x\\r\\n",
        "200 bodies declared, never sent": b"POST /alerts HTTP/1.1\\r\\nHost: x\\r\\nContent-Length: 900000\\r\\n\\r\\n{",
    }
    try:
        for case, first in kinds.items():
            socks = []
            for _ in range(200):
                sock = socket.create_connection(("127.0.0.1", port))
                sock.sendall(first)
                socks.append(sock)
            deadline = time.perf_counter() + 5.0
            held = 0
            for sock in socks:
                sock.settimeout(max(deadline - time.perf_counter(), 0.01))
                try:
                    while sock.recv(65536):
                        pass
                except ConnectionResetError:
                    pass
                except TimeoutError:
                    held += 1
                sock.close()
            record("http", case, "handled" if held == 0 else "silent", f"{held} still held after 5 s")
    finally:
        server.should_exit = True
        thread.join(timeout=10)


def sweep_receiver_triggers() -> None:
    """An alert during the cooldown, and one during an unconfirmed trigger, are never lost."""
    import threading

    from fastapi.testclient import TestClient

    from pruneops.serving.receiver import create_receiver

    auth = {"Authorization": "Bearer t"}
    runs: list[str] = []
    client = TestClient(create_receiver("t", lambda a: runs.append(a["fingerprint"]) or "run", cooldown_s=0.3))

    def alert(fp: str) -> dict:
        return {"alerts": [{"status": "firing", "fingerprint": fp, "labels": {"alertname": fp}}]}

    client.post("/alerts", json=alert("a"), headers=auth)
    client.post("/alerts", json=alert("b"), headers=auth)  # cooldown
    time.sleep(0.4)
    repeat = client.post("/alerts", json=alert("b"), headers=auth).json()
    ok = repeat.get("triggered") == 1 and runs == ["a", "b"]
    record("receiver", "alert during the cooldown, repeated after it", "handled" if ok else "silent", str(repeat))

    started, release, calls = threading.Event(), threading.Event(), []

    def slow_failing(a: dict) -> str:
        calls.append(a["fingerprint"])
        if len(calls) == 1:
            started.set()
            release.wait(5)
            raise ConnectionError("Prefect down")
        return "run"

    client = TestClient(create_receiver("t", slow_failing, cooldown_s=600), raise_server_exceptions=False)
    with ThreadPoolExecutor(1) as pool:
        first = pool.submit(client.post, "/alerts", json=alert("a"), headers=auth)
        started.wait(5)
        during = client.post("/alerts", json=alert("b"), headers=auth).status_code
        release.set()
        first.result()
    retried = client.post("/alerts", json=alert("b"), headers=auth).json()
    ok = during == 503 and retried.get("triggered") == 1
    record("receiver", "alert during a trigger that then fails", "handled" if ok else "silent", f"{during}, {retried}")


def sweep_lineage_and_code(work: Path) -> None:
    """Files DVC would ignore, a symlink loop, a secret file as the data, code named by an override."""
    for case, key, value in (
        ("pretrained weights inside models/ (the registry)", "init_weights", "models/mine/w.safetensors"),
        ("weights inside state/", "init_weights", "state/w.safetensors"),
    ):
        root = Path(tempfile.mkdtemp(dir=work))
        (root / ".dvc").mkdir()
        shutil.copy(ROOT / ".dvcignore", root / ".dvcignore")
        (root / value).parent.mkdir(parents=True, exist_ok=True)
        params = base_params()
        params["train"][key] = value
        (root / "params.yaml").write_text(yaml.safe_dump(params))
        for command in ("dvc-yaml", "train"):
            run_and_classify("lineage", f"{case}: {command}", root, command)
    root = Path(tempfile.mkdtemp(dir=work))
    (root / "loop").symlink_to(root / "loop")
    params = base_params()
    params["validate"].update(dataset="npz", path="loop")
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    for command in ("dvc-yaml", "validate"):
        run_and_classify("lineage", f"dataset path a symlink loop: {command}", root, command)

    root = Path(tempfile.mkdtemp(dir=work))
    (root / "secret.txt").write_text("hunter2-api-key-0123456789abcdef\\n")
    params = base_params()
    params["validate"].update(dataset="table", path="secret.txt")
    (root / "params.yaml").write_text(yaml.safe_dump(params))
    result = cli(root, "validate")
    leaked = "hunter2" in result.stderr
    if leaked:
        record("data", "a secret file named as the table", "silent", "its first line is in the error")
    else:
        classify_cli("data", "a secret file named as the table", root, result, "validate", False)

    from pruneops.core.errors import ConfigError
    from pruneops.pipeline.experiments import apply_overrides

    for case, overrides in (
        ("flow override train.model os:system", {"train.model": "os:system"}),
        ("flow override hiding code in a mapping", {"train.model_kwargs": {"f": "subprocess:run"}}),
    ):
        try:
            apply_overrides(base_params(), overrides)
            record("code", case, "silent", "accepted")
        except ConfigError as exc:
            record("code", case, "handled" if exc.exit_code == 2 else "silent", str(exc)[:100])
    root = Path(tempfile.mkdtemp(dir=work))
    (root / "params.yaml").write_text(yaml.safe_dump(base_params()))
    env = {**os.environ, "PRUNEOPS_SET": "reprune.drift_source=os:system"}
    result = subprocess.run(
        [sys.executable, "-m", "pruneops.cli", "--root", str(root), "validate"],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env=env,
    )
    classify_cli("code", "PRUNEOPS_SET naming code", root, result, "validate", False)


def sweep_monitoring_fit() -> None:
    """A 73-78 % model served with defaults raises no alert on in-distribution traffic."""
    from fastapi.testclient import TestClient

    import tests.serving.test_monitoring_fit as fit
    from pruneops.serving.app import create_app

    class Factory:
        def mktemp(self, name: str) -> Path:
            return Path(tempfile.mkdtemp(prefix=name))

    config, test, accuracy = fit.weak_model.__wrapped__(Factory())
    with TestClient(create_app(config)) as client:
        scrapes = fit._serve_traffic(client, test, 800, lambda j, _: int(test.y[j]))
    fired = sorted({alert for text in scrapes for alert, on in fit._alerts(text).items() if on})
    armed = bool(fit._gauges(scrapes[-1], "pruneops_accuracy_threshold"))
    outcome = "handled" if not fired and armed else "silent"
    record("monitoring", f"{100 * accuracy:.0f} % model, defaults, 800 requests", outcome, f"alerts: {fired or 'none'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workdir", default=None)
    args = parser.parse_args()
    work = Path(args.workdir or tempfile.mkdtemp(prefix="pruneops-sweep-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("GX_ANALYTICS_ENABLED", "false")
    started = time.time()
    pipeline = _pipeline(work)
    sweep_params(work, pipeline)
    sweep_data(work)
    sweep_image_folders(work)
    sweep_checkpoints(work, pipeline)
    sweep_prepared_splits(work, pipeline)
    sweep_registry(work)
    sweep_http(work)
    sweep_receiver()
    sweep_kill(work, pipeline)
    sweep_artifacts(work, _exported(work))
    sweep_registry_faults(work)
    sweep_feedback_and_startup(work)
    sweep_slow_clients()
    sweep_receiver_triggers()
    sweep_lineage_and_code(work)
    sweep_monitoring_fit()
    from tests.sweep.decoder_sweep import sweep_decoder

    sweep_decoder(work, record, _http_case)
    totals = Counter(outcome for _, _, outcome, _ in RESULTS)
    by_entry = Counter(entry for entry, _, _, _ in RESULTS)
    print(
        f"\n{len(RESULTS)} cases in {time.time() - started:.0f} s: " + ", ".join(f"{k} {v}" for k, v in totals.items())
    )
    print("per entry point: " + ", ".join(f"{k} {v}" for k, v in by_entry.items()))
    for entry, case, outcome, detail in RESULTS:  # repeated last, where a log's tail shows them
        if outcome != "handled":
            print(f"NOT HANDLED: {outcome} {entry} / {case}: {detail[:200]}")
    return len(RESULTS) - totals["handled"]


if __name__ == "__main__":
    sys.exit(main())
