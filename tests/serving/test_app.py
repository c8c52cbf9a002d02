"""The serving app: validation, predictions, feedback, metrics, hot reload and refusal."""

import json
import os

import numpy as np
import pytest

pytest.importorskip("fastapi", reason="fastapi is not installed")
from fastapi.testclient import TestClient  # noqa: E402

from pruneops.modelstore.store import ModelRegistry  # noqa: E402
from pruneops.serving.app import ServingConfig, create_app  # noqa: E402
from tests.conftest import digits_onnx  # noqa: E402


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    root = tmp_path_factory.mktemp("serving")
    data_dir, onnx_path, test = digits_onnx(root, name="good.onnx")
    registry = ModelRegistry(root / "models")
    registry.promote(registry.register(onnx_path, {"sparsity": 0.0}, version="v1").version)
    config = ServingConfig(
        production=root / "models/production",
        reference_stats=data_dir / "reference_stats.json",
        drift_window=100,
        drift_min_samples=10,
        reload_interval_s=3600,
    )
    return root, registry, config, test


def test_predict_feedback_and_metrics(setup, tmp_path):
    _, _, config, test = setup
    config = config.model_copy(update={"feedback_path": tmp_path / "feedback.npz", "feedback_flush_every": 8})
    with TestClient(create_app(config)) as client:
        assert client.get("/readyz").json() == {"status": "ready", "model_version": "v1"}
        r = client.post("/predict", json={"inputs": test.x[:20].tolist()})
        assert r.status_code == 200
        body = r.json()
        assert len(body["classes"]) == 20 and len(set(body["prediction_ids"])) == 20
        np.testing.assert_allclose(np.sum(body["probabilities"], axis=1), 1.0, atol=1e-4)
        single = client.post("/predict", json={"inputs": test.x[0].tolist()}).json()
        assert len(single["classes"]) == 1
        for pid, label in zip(body["prediction_ids"], test.y[:20], strict=True):
            fb = client.post("/feedback", json={"prediction_id": pid, "label": int(label)})
        expected = float(np.mean(np.array(body["classes"]) == test.y[:20]))
        assert fb.json() == {"rolling_accuracy": pytest.approx(expected), "window": 20}
        assert client.post("/feedback", json={"prediction_id": "nope", "label": 1}).status_code == 404
        text = client.get("/metrics").text
        assert 'pruneops_requests_total{endpoint="predict",status="200"} 2.0' in text
        assert 'pruneops_inference_latency_seconds_bucket{le="0.001",model_version="v1"}' in text
        assert f'pruneops_accuracy{{model_version="v1"}} {expected}' in text
        assert 'pruneops_accuracy_samples{model_version="v1"} 20.0' in text
        assert 'pruneops_drift_score{group="overall"}' in text and 'pruneops_drift_score{group="row_03"}' in text
        assert 'pruneops_model_info{macs="",params="",sparsity="0.0",version="v1"} 1.0' in text
        assert 'pruneops_drift_threshold{stat="psi"} 0.2' in text
        with np.load(tmp_path / "feedback.npz") as saved:  # flushed after 8 and 16 labels
            assert len(saved["y_train"]) + len(saved["y_test"]) == 16
            assert saved["x_train"].shape[1:] == (1, 8, 8)
    with np.load(tmp_path / "feedback.npz") as saved:  # and at shutdown: all 20
        assert len(saved["y_train"]) + len(saved["y_test"]) == 20
        np.testing.assert_array_equal(np.concatenate([saved["y_train"], saved["y_test"]]), test.y[:20])


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        ('{"inputs": [[1, 2', "invalid request"),
        ('{"inputs": [[0.1, 0.2]]}', "each input must have shape [1, 8, 8]"),
        ('{"inputs": [[[[NaN, 0, 0, 0, 0, 0, 0, 0]]]]}', "shape"),
        ('{"wrong": 1}', "send exactly one of inputs (numbers) or images"),
        ('{"inputs": [[0.1]], "images": ["aGk="]}', "send exactly one of inputs (numbers) or images"),
        ('{"inputs": [[[[1, 2], [3]]]]}', "regular shape"),
    ],
)
def test_bad_requests_get_4xx_with_a_message_and_serving_continues(setup, payload, message):
    _, _, config, test = setup
    with TestClient(create_app(config)) as client:
        r = client.post("/predict", content=payload, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500 and message in r.json()["error"]
        assert client.post("/predict", json={"inputs": test.x[:2].tolist()}).status_code == 200


def test_nan_is_refused(setup):
    _, _, config, test = setup
    x = test.x[:1].copy()
    body = json.dumps({"inputs": x.tolist()}).replace("0.0", "NaN", 1)
    with TestClient(create_app(config)) as client:
        r = client.post("/predict", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 422 and "finite" in r.json()["error"]
        assert 'pruneops_requests_total{endpoint="predict",status="422"} 1.0' in client.get("/metrics").text


def test_hot_reload_swaps_promoted_model_and_refuses_a_corrupt_one(setup, tmp_path):
    root, registry, config, test = setup
    with TestClient(create_app(config)) as client:
        v2 = registry.register(root / "good.onnx", {"sparsity": 0.5}, version="v2")
        registry.promote(v2.version)
        client.app.state.refresh()
        assert client.post("/predict", json={"inputs": test.x[:1].tolist()}).json()["model_version"] == "v2"
        v3 = registry.register(root / "good.onnx", {}, version="v3")
        registry.promote(v3.version)
        v3.model_file.write_bytes(b"not onnx")  # corrupted after it was promoted
        client.app.state.refresh()
        r = client.post("/predict", json={"inputs": test.x[:1].tolist()})
        assert r.status_code == 200 and r.json()["model_version"] == "v2"
        assert "pruneops_model_reload_errors_total 1.0" in client.get("/metrics").text
        registry.rollback()


def test_drift_reference_comes_with_the_served_model(setup, tmp_path):
    root, _, config, test = setup
    registry = ModelRegistry(tmp_path / "models")
    registry.promote(registry.register(root / "good.onnx", {}, version="plain").version)
    config = config.model_copy(update={"production": tmp_path / "models/production", "reference_stats": None})
    with TestClient(create_app(config)) as client:
        monitor = client.app.state.monitor
        client.post("/predict", json={"inputs": test.x[:20].tolist()})
        assert monitor.reference is None and monitor.scores() is None  # no reference: no score, not a wrong one
        # A re-pruned model brings the statistics of the data it was trained on.
        shifted = json.loads((root / "artifacts/validate/reference_stats.json").read_text())
        shifted["class_frequencies"] = [1.0] + [0.0] * (len(shifted["classes"]) - 1)
        (tmp_path / "ref.json").write_text(json.dumps(shifted))
        v = registry.register(root / "good.onnx", {}, version="with-ref", reference_stats=tmp_path / "ref.json")
        registry.promote(v.version)
        client.app.state.refresh()
        assert monitor.reference == shifted
        client.post("/predict", json={"inputs": test.x[:20].tolist()})
        scores = monitor.scores()
        assert scores is not None and scores.window == 20
        # Predictions spread over ten classes against a one-class reference: large prediction drift.
        assert scores.prediction_psi > 1.0


def test_an_unhandled_error_is_a_counted_500_and_serving_goes_on(setup, monkeypatch):
    _, _, config, test = setup
    app = create_app(config)
    state = app.state.serving
    calls = {"n": 0}
    real_predict = state.predict

    def flaky(model, x, texts=None):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("injected")
        return real_predict(model, x, texts)

    monkeypatch.setattr(state, "predict", flaky)
    with TestClient(app, raise_server_exceptions=False) as client:
        r = client.post("/predict", json={"inputs": test.x[:1].tolist()})
        assert r.status_code == 500 and r.json() == {"error": "internal error: RuntimeError"}
        assert client.post("/predict", json={"inputs": test.x[:1].tolist()}).status_code == 200
        assert client.get("/nowhere").status_code == 404
        text = client.get("/metrics").text
    assert 'pruneops_requests_total{endpoint="predict",status="500"} 1.0' in text
    assert 'pruneops_requests_total{endpoint="predict",status="200"} 1.0' in text
    assert 'pruneops_requests_total{endpoint="other",status="404"} 1.0' in text


def test_concurrent_feedback_while_flushing_loses_and_breaks_nothing(setup, tmp_path):
    from concurrent.futures import ThreadPoolExecutor

    _, _, config, test = setup
    config = config.model_copy(update={"feedback_path": tmp_path / "feedback.npz", "feedback_flush_every": 3})
    with TestClient(create_app(config)) as client:
        ids = client.post("/predict", json={"inputs": test.x[:200].tolist()}).json()["prediction_ids"]
        state = client.app.state.serving

        def send(i):
            return client.post("/feedback", json={"prediction_id": ids[i], "label": int(test.y[i])}).status_code

        with ThreadPoolExecutor(8) as pool:
            flushes = [pool.submit(state.flush_feedback) for _ in range(20)]
            statuses = list(pool.map(send, range(200)))
            for f in flushes:
                f.result()
        assert statuses == [200] * 200
        assert client.post("/feedback", json={"prediction_id": ids[0], "label": 3}).status_code == 409  # once
    with np.load(tmp_path / "feedback.npz") as saved:  # the final flush holds every label, in order of arrival
        labels = np.concatenate([saved["y_train"], saved["y_test"]])
        assert len(labels) == 200 and saved["x_train"].shape[1:] == (1, 8, 8)
    assert not list(tmp_path.glob("*.tmp.npz"))


def test_openapi_documents_the_responses(setup):
    _, _, config, _ = setup
    schema = create_app(config).openapi()
    predict = schema["paths"]["/predict"]["post"]["responses"]
    assert predict["200"]["content"]["application/json"]["schema"]["$ref"].endswith("PredictResponse")
    assert predict["422"]["content"]["application/json"]["schema"]["$ref"].endswith("ErrorResponse")
    assert schema["paths"]["/feedback"]["post"]["responses"]["200"]["content"]["application/json"]["schema"][
        "$ref"
    ].endswith("FeedbackResponse")


def _wait_for_version(client, x, version, seconds):
    import time

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if client.post("/predict", json={"inputs": x}).json().get("model_version") == version:
            return True
        time.sleep(0.05)
    return False


def test_broken_reference_statistics_then_a_good_promotion_serves_within_three_intervals(setup, tmp_path):
    root, _, config, test = setup
    registry = ModelRegistry(tmp_path / "models")
    registry.promote(registry.register(root / "good.onnx", {}, version="v1").version)
    broken = tmp_path / "broken.json"
    broken.write_text('{"bin_edges": [0.0, 1.0], "histograms": "not a list"}')
    interval = 1.0
    config = config.model_copy(update={"production": tmp_path / "models/production", "reload_interval_s": interval})
    x = test.x[:1].tolist()
    with TestClient(create_app(config)) as client:
        assert client.post("/predict", json={"inputs": x}).json()["model_version"] == "v1"
        # `promote` refuses such a version now; point production at it the way an old promoter did.
        registry.register(root / "good.onnx", {}, version="v2", reference_stats=broken)
        os.symlink("candidates/v2", tmp_path / "models/.link")
        os.replace(tmp_path / "models/.link", registry.production_link)
        assert not _wait_for_version(client, x, "v2", 3 * interval)  # refused: v1 keeps serving
        registry.promote(registry.register(root / "good.onnx", {}, version="v3").version)
        assert _wait_for_version(client, x, "v3", 3 * interval), "the watcher stopped reloading"
        text = client.get("/metrics").text
    assert "pruneops_model_reload_errors_total 1.0" in text
    assert 'pruneops_model_info{macs="",params="",sparsity="",version="v3"} 1.0' in text


def test_the_watcher_outlives_any_error(setup, tmp_path, monkeypatch):
    root, _, config, test = setup
    registry = ModelRegistry(tmp_path / "models")
    registry.promote(registry.register(root / "good.onnx", {}, version="v1").version)
    config = config.model_copy(update={"production": tmp_path / "models/production", "reload_interval_s": 0.2})
    app = create_app(config)
    state, calls = app.state.serving, {"n": 0}
    real = state.holder.refresh

    def exploding():
        calls["n"] += 1
        if calls["n"] in (2, 3):  # the first call is the start-up load
            raise RuntimeError("injected")
        return real()

    monkeypatch.setattr(state.holder, "refresh", exploding)
    with TestClient(app) as client:
        registry.promote(registry.register(root / "good.onnx", {}, version="v2").version)
        assert _wait_for_version(client, test.x[:1].tolist(), "v2", 5.0)
        assert "pruneops_model_reload_errors_total 2.0" in client.get("/metrics").text


def test_a_corrupt_production_model_on_restart_falls_back_to_the_last_good_version(setup, tmp_path):
    root, _, config, test = setup
    registry = ModelRegistry(tmp_path / "models")
    for version in ("v1", "v2"):
        registry.promote(registry.register(root / "good.onnx", {}, version=version).version)
    registry.get("v2").model_file.write_bytes(b"\x00" * 100)  # disk corruption while the app was down
    config = config.model_copy(update={"production": tmp_path / "models/production", "reload_interval_s": 3600})
    with TestClient(create_app(config)) as client:
        assert client.get("/readyz").json() == {"status": "ready", "model_version": "v1"}
        assert client.post("/predict", json={"inputs": test.x[:1].tolist()}).status_code == 200
        text = client.get("/metrics").text
        assert "pruneops_model_fallback 1.0" in text and "pruneops_model_reload_errors_total 1.0" in text
        registry.promote(registry.register(root / "good.onnx", {}, version="v3").version)
        client.app.state.refresh()
        assert client.get("/readyz").json()["model_version"] == "v3"
        assert "pruneops_model_fallback 0.0" in client.get("/metrics").text


@pytest.mark.parametrize("label", [10, -1, 10**30])
def test_a_label_outside_the_models_classes_is_refused_and_feedback_goes_on(setup, tmp_path, label):
    _, _, config, test = setup
    config = config.model_copy(update={"feedback_path": tmp_path / "feedback.npz", "feedback_flush_every": 2})
    with TestClient(create_app(config)) as client:
        ids = client.post("/predict", json={"inputs": test.x[:3].tolist()}).json()["prediction_ids"]
        r = client.post("/feedback", json={"prediction_id": ids[0], "label": label})
        assert r.status_code == 422 and "label must be a class of the served model: 0..9" in r.json()["error"]
        for pid in ids[1:]:
            assert client.post("/feedback", json={"prediction_id": pid, "label": 3}).status_code == 200
    with np.load(tmp_path / "feedback.npz") as saved:
        assert np.concatenate([saved["y_train"], saved["y_test"]]).tolist() == [3, 3]


def test_a_huge_body_is_refused_before_it_is_parsed(setup):
    import time

    _, _, config, _ = setup
    body = b'{"inputs": [' + b"0.5, " * 10_000_000 + b"0.5]}"  # ~50 MB
    with TestClient(create_app(config)) as client:
        started = time.perf_counter()
        r = client.post("/predict", content=body, headers={"content-type": "application/json"})
        assert r.status_code == 413 and "over" in r.json()["error"]

        def chunks():  # no content-length: counted as it streams
            for _ in range(100):
                yield b" " * 1_000_000

        r = client.post("/predict", content=chunks(), headers={"content-type": "application/json"})
        assert r.status_code == 413
        assert time.perf_counter() - started < 5.0
        assert 'pruneops_requests_total{endpoint="predict",status="413"} 2.0' in client.get("/metrics").text


def _png_base64(pixels: np.ndarray, mode: str = "L") -> str:
    import base64
    import io

    from PIL import Image

    buffer = io.BytesIO()
    Image.fromarray(pixels.astype(np.uint8), mode=mode).save(buffer, format="PNG")
    return base64.b64encode(buffer.getvalue()).decode()


def _png_bomb_base64() -> str:
    import base64

    from tests.conftest import png_bomb

    return base64.b64encode(png_bomb()).decode()


def test_raw_png_images_are_served_as_validate_prepared_the_data(setup, tmp_path):
    """Digits scaled from 0..16 by validate: a PNG of the raw values must give the same predictions."""
    root, _, config, test = setup
    registry = ModelRegistry(tmp_path / "models")
    names = [f"digit {i}" for i in range(10)]
    meta = {"input": {"input_shape": [1, 8, 8], "value_range": [0.0, 16.0], "class_names": names}}
    registry.promote(registry.register(root / "good.onnx", meta, version="v-img").version)
    config = config.model_copy(update={"production": tmp_path / "models/production"})
    raw = np.rint(test.x[:12, 0] * 16)  # the integers the embedded digits hold
    with TestClient(create_app(config)) as client:
        by_inputs = client.post("/predict", json={"inputs": test.x[:12].tolist()}).json()
        by_images = client.post("/predict", json={"images": [_png_base64(r) for r in raw]}).json()
        assert by_images["classes"] == by_inputs["classes"]
        np.testing.assert_allclose(by_images["probabilities"], by_inputs["probabilities"], atol=1e-5)
        assert by_images["class_names"] == [names[c] for c in by_inputs["classes"]]
        # An RGB image of another size is converted and resized to the data's 1x8x8, not refused.
        rgb = np.repeat(np.kron(raw[0], np.ones((2, 2)))[..., None], 3, axis=2)
        assert client.post("/predict", json={"images": [_png_base64(rgb, "RGB")]}).status_code == 200
        for images, message in (
            (["not base64!"], "images[0]: not base64"),
            ([_png_base64(raw[0]), "aGVsbG8="], "images[1]: not a readable PNG/JPEG image"),
            ([], "batch size must be 1.."),
            ([_png_bomb_base64()], "images[0]: larger than"),
        ):
            r = client.post("/predict", json={"images": images})
            assert r.status_code == 422 and message in r.json()["error"], r.json()
        text = client.get("/metrics").text
        assert 'pruneops_requests_total{endpoint="predict",status="200"} 3.0' in text
        assert 'pruneops_requests_total{endpoint="predict",status="422"} 4.0' in text


def test_images_need_a_model_version_that_records_its_value_range(setup):
    _, _, config, test = setup
    with TestClient(create_app(config)) as client:  # v1 was registered without an input description
        r = client.post("/predict", json={"images": [_png_base64(np.zeros((8, 8)))]})
        assert r.status_code == 422 and "does not record its data's value range" in r.json()["error"]
