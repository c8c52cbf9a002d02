"""The standing sweep of bad input: every params section, the data loaders, the HTTP apps.

- params: any value for any key of any section (or a section that is not a mapping) gives a valid
  config or one `ConfigError` line, never another exception; a few random files go through the CLI
  and must exit with one line and no traceback or signal;
- data: any NPZ content and any table text gives `RawData` or a `DataError`;
- HTTP: schemathesis runs bounded generated requests against the serving app and the receiver's
  OpenAPI schemas: no 5xx.
"""

from __future__ import annotations

import io
import math
import subprocess
import sys

import numpy as np
import pytest
import yaml

hypothesis = pytest.importorskip("hypothesis", reason="hypothesis (the dev extra) is not installed")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from pruneops.config import ValidateConfig  # noqa: E402
from pruneops.core.errors import ConfigError, DataError  # noqa: E402
from pruneops.core.params import read_params  # noqa: E402
from pruneops.data.loaders import load_raw  # noqa: E402
from pruneops.pipeline.stages import SECTIONS, load_configs  # noqa: E402
from tests.conftest import ROOT  # noqa: E402

BASE = read_params(ROOT / "params.yaml")
SWEEP = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])

extremes = st.sampled_from(
    [0, -1, 1, 2**31, 2**63, -(2**63), 10**30, 1e308, -1e308, math.inf, -math.inf, math.nan, 1e-320, ""]
)
text = st.text(alphabet=st.characters(codec="utf-8"), max_size=30)
scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), text, extremes)
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=4) | st.dictionaries(text, inner, max_size=3))


@st.composite
def mutated_params(draw):
    params = yaml.safe_load(yaml.safe_dump(BASE))
    for _ in range(draw(st.integers(1, 3))):
        section = draw(st.sampled_from(sorted(SECTIONS)))
        if draw(st.integers(0, 9)) == 0:
            params[section] = draw(values)  # the whole section is garbage
            continue
        if not isinstance(params.get(section), dict):
            continue
        keys = sorted(SECTIONS[section].model_fields)
        key = draw(st.sampled_from(keys) | text)
        params[section][key] = draw(values)
    return params


@SWEEP
@given(mutated_params())
def test_any_params_value_is_a_valid_config_or_one_config_error_line(params):
    try:
        load_configs(params)
    except ConfigError as exc:
        message = str(exc)
        assert message and "\n" not in message and exc.exit_code == 2


@pytest.mark.slow
@settings(
    max_examples=6, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture]
)
@given(params=mutated_params(), stage=st.sampled_from(["validate", "prune", "quantize"]))
def test_the_cli_answers_bad_params_with_one_line_and_no_traceback(tmp_path, params, stage):
    path = tmp_path / "params.yaml"
    try:
        path.write_text(yaml.safe_dump(params, allow_unicode=True))
    except yaml.YAMLError:
        return
    result = subprocess.run(
        [sys.executable, "-m", "pruneops.cli", "--params", str(path), "--root", str(tmp_path), stage],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode in (0, 1, 2), result.returncode  # a signal is negative
    assert "Traceback" not in result.stderr and "internal error" not in result.stderr
    if result.returncode:
        assert len([line for line in result.stderr.splitlines() if line.startswith(f"pruneops {stage}: ")]) == 1


dtypes = st.sampled_from(["uint8", "int8", "int64", "float16", "float32", "float64", "bool", "complex64", "U3"])


@st.composite
def npz_bytes(draw):
    arrays = {}
    for key in ("x_train", "y_train", "x_test", "y_test"):
        if draw(st.integers(0, 9)) == 0:
            continue  # a missing array
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=4)))
        dtype = draw(dtypes)
        if dtype == "U3":
            arrays[key] = np.full(shape, "ab", dtype=dtype)
        else:
            fill = draw(st.sampled_from([0, 1, 3, 255, -7, 1.5, 1e30, math.nan]))
            with np.errstate(all="ignore"):
                arrays[key] = np.full(shape, fill).astype(dtype)
    buffer = io.BytesIO()
    np.savez(buffer, **arrays)
    data = buffer.getvalue()
    if draw(st.booleans()):
        data = data[: draw(st.integers(0, len(data)))]  # truncated
    return data


@SWEEP
@given(data=npz_bytes() | st.binary(max_size=300))
def test_any_npz_file_loads_or_is_one_data_error(tmp_path_factory, data):
    path = tmp_path_factory.mktemp("npz") / "data.npz"
    path.write_bytes(data)
    raw = _loaded_or_one_data_error(ValidateConfig(dataset="npz", path=str(path)))
    if raw is not None:
        assert len(raw.x_train) == len(raw.y_train) > 0 and raw.y_train.min() >= 0


def _loaded_or_one_data_error(config: ValidateConfig):
    """The loaded data (inputs float32, labels int64), or None after a one-line `DataError`."""
    try:
        raw = load_raw(config)
    except DataError as exc:
        assert "\n" not in str(exc)
        return None
    assert raw.x_train.dtype == np.float32 and raw.y_train.dtype == np.int64
    return raw


@SWEEP
@given(body=st.text(max_size=400) | st.binary(max_size=300).map(lambda b: b.decode("latin-1")))
def test_any_table_file_loads_or_is_one_data_error(tmp_path_factory, body):
    path = tmp_path_factory.mktemp("csv") / "data.csv"
    path.write_text("label,a,b\n" + body, encoding="utf-8", errors="surrogateescape")
    _loaded_or_one_data_error(ValidateConfig(dataset="table", path=str(path)))


def _maybe_corrupted(draw, data: bytes, truncate_one_in: int) -> bytes:
    """`data` as it is, or truncated (one in `truncate_one_in`), or else garbage (one in 10)."""
    if draw(st.integers(0, truncate_one_in - 1)) == 0:
        return data[: draw(st.integers(0, len(data)))]
    if draw(st.integers(0, 9)) == 0:
        return draw(st.binary(max_size=40))
    return data


def _folder_loaded_or_one_data_error(tmp_path_factory, dataset: str, files: dict[str, bytes]):
    """Writes `files` (relative path -> bytes) into a fresh folder and loads it as `dataset`."""
    folder = tmp_path_factory.mktemp(dataset)
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)
    return _loaded_or_one_data_error(ValidateConfig(dataset=dataset, path=str(folder)))


def idx_bytes(array: np.ndarray, code: int = 0x08) -> bytes:
    """An IDX file of `array` (big-endian, as MNIST ships)."""
    import struct

    dtype = {0x08: ">u1", 0x09: ">i1", 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}[code]
    head = bytes([0, 0, code, array.ndim]) + struct.pack(f">{array.ndim}I", *array.shape)
    return head + np.ascontiguousarray(array, dtype=dtype).tobytes()


@st.composite
def idx_folder_files(draw):
    """The four IDX files, each possibly corrupt: wrong type code or rank, truncated, gzipped or not."""
    import gzip

    n_train, n_test, side = draw(st.integers(0, 5)), draw(st.integers(0, 5)), draw(st.integers(1, 4))
    files = {}
    for stem, shape in (
        ("train-images-idx3-ubyte", (n_train, side, side)),
        ("train-labels-idx1-ubyte", (n_train,)),
        ("t10k-images-idx3-ubyte", (n_test, side, side)),
        ("t10k-labels-idx1-ubyte", (n_test,)),
    ):
        shape = draw(st.sampled_from([shape, shape[:1], (*shape, 2)])) if draw(st.integers(0, 5)) == 0 else shape
        code = draw(st.sampled_from([0x08, 0x08, 0x09, 0x0C, 0x0D]))
        fill = draw(st.sampled_from([0, 3, 200, -1, 1e9, math.nan])) if code == 0x0D else draw(st.integers(0, 9))
        with np.errstate(all="ignore"):
            data = idx_bytes(np.full(shape, fill).astype(np.float64 if code == 0x0D else np.int64), code)
        data = _maybe_corrupted(draw, data, truncate_one_in=5)
        gz = draw(st.booleans())
        files[stem + (".gz" if gz else "")] = gzip.compress(data) if gz else data
    return files


@SWEEP
@given(files=idx_folder_files())
def test_any_idx_folder_loads_or_is_one_data_error(tmp_path_factory, files):
    raw = _folder_loaded_or_one_data_error(tmp_path_factory, "idx", files)
    if raw is not None:
        assert raw.x_train.shape[0] == len(raw.y_train) and raw.x_train.ndim == 4


@st.composite
def image_folder_files(draw):
    """Class folders of images: PNG or JPEG of random size and mode, some truncated or plain garbage."""
    from PIL import Image

    files = {}
    for c in range(draw(st.integers(1, 3))):
        for i in range(draw(st.integers(0, 3))):
            mode = draw(st.sampled_from(["L", "RGB", "RGBA", "1", "P", "I;16"]))
            size = (draw(st.integers(1, 4)), draw(st.integers(1, 4)))
            fmt = draw(st.sampled_from(["PNG", "JPEG"])) if mode in ("L", "RGB") else "PNG"
            buffer = io.BytesIO()
            Image.new(mode, size, color=draw(st.integers(0, 255))).save(buffer, format=fmt)
            data = buffer.getvalue()
            data = _maybe_corrupted(draw, data, truncate_one_in=6)
            files[f"c{c}/{i}.{fmt.lower()}"] = data
    return files


@SWEEP
@given(files=image_folder_files())
def test_any_image_folder_loads_or_is_one_data_error(tmp_path_factory, files):
    raw = _folder_loaded_or_one_data_error(tmp_path_factory, "image_folder", files)
    if raw is not None:
        assert raw.x_train.shape[0] == len(raw.y_train) and raw.x_train.shape[1] in (1, 3)
        assert raw.x_train.min() >= 0.0 and raw.x_train.max() <= 255.0


schemathesis = pytest.importorskip("schemathesis", reason="schemathesis (the dev extra) is not installed")


def _serving_app():
    import tempfile
    from pathlib import Path

    from pruneops.modelstore.store import ModelRegistry
    from pruneops.serving.app import ServingConfig, create_app
    from tests.conftest import digits_onnx

    root = Path(tempfile.mkdtemp(prefix="pruneops-sweep-"))
    data_dir, onnx_path, _ = digits_onnx(root, trained=False)
    registry = ModelRegistry(root / "models")
    registry.promote(registry.register(onnx_path, {}, version="v1").version)
    config = ServingConfig(
        production=root / "models/production",
        reference_stats=data_dir / "reference_stats.json",
        feedback_path=root / "feedback.npz",
        feedback_flush_every=5,
        drift_min_samples=5,
        reload_interval_s=3600,
    )
    app = create_app(config)
    app.state.refresh()  # what the lifespan does at start-up
    return app


serving_schema = schemathesis.openapi.from_asgi("/openapi.json", _serving_app())


@serving_schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_serving_app_answers_generated_requests_without_5xx(case):
    response = case.call()
    assert response.status_code < 500, (case.path, response.status_code, response.text[:300])


def _receiver_app():
    from pruneops.serving.receiver import create_receiver

    return create_receiver("sweep-token", lambda alert: "run-1", cooldown_s=0)


receiver_schema = schemathesis.openapi.from_asgi("/openapi.json", _receiver_app())


@receiver_schema.parametrize()
@settings(max_examples=40, deadline=None, suppress_health_check=list(HealthCheck))
def test_receiver_answers_generated_requests_without_5xx(case):
    if case.path != "/healthz" and hash(str(case.body)) % 2:  # half the requests get past the token
        case.headers = {**(case.headers or {}), "Authorization": "Bearer sweep-token"}
    response = case.call()
    assert response.status_code < 500, (case.path, response.status_code, response.text[:300])
