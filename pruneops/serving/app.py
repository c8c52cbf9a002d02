"""FastAPI app: /predict, /feedback, /healthz, /readyz, /metrics over the production model.

All mutable state lives in one `ServingState` behind a lock; HTTP metrics come from one
middleware, so every response (an unhandled 500 included) is counted by endpoint and status.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import threading
import time
import uuid
from collections import OrderedDict, deque
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import FastAPI, HTTPException, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field, StrictInt

from pruneops.config import ServeConfig
from pruneops.core.errors import ConfigError
from pruneops.core.io import Layout, read_json
from pruneops.data.drift import DriftMonitor
from pruneops.modelstore.store import ModelRegistry, RegistryError, ServableModel, pipeline_reference_stats
from pruneops.serving.accuracy import accuracy_threshold, expected_accuracy
from pruneops.serving.limits import BodyLimit
from pruneops.serving.model import ModelHolder
from pruneops.serving.parsing import PredictRequest, feedback_label, parse_inputs

log = logging.getLogger("pruneops.serving")

# Millisecond-scale inference: buckets from 50 us to 1 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)
KNOWN_ENDPOINTS = ("predict", "feedback", "healthz", "readyz", "metrics")


class ServingConfig(ServeConfig):
    """How the app serves: the `serve` params section, and where the model and its statistics are.

    The tunables (windows, thresholds, limits) and their bounds are `ServeConfig`'s, one schema
    for the params section and the app.
    """

    # Built by code (the CLI, tests), not read from YAML: plain pydantic coercion (a str path).
    model_config = ConfigDict(extra="forbid", frozen=True, strict=False)

    production: Path = Path("models/production")
    # Used until a model that carries its own reference statistics is loaded.
    reference_stats: Path | None = pipeline_reference_stats(Layout())
    feedback_path: Path | None = None
    threads: Annotated[int, Field(ge=1, le=256)] = 1
    # `reprune.accuracy_tolerance`: how far below its test accuracy the served model may fall.
    accuracy_tolerance: Annotated[float, Field(ge=0.0, le=1.0)] = 0.005
    # `reprune.latency_slo_ms`: the latency alert's threshold.
    latency_slo_ms: Annotated[float, Field(gt=0.0, le=1e6)] = 1.0


class PredictResponse(BaseModel):
    """Predicted classes and probabilities, with ids to send feedback for."""

    prediction_ids: list[str]
    classes: list[int]
    probabilities: list[list[float]]
    model_version: str
    class_names: list[str] | None = None  # each prediction's class name, where the data named its classes


class FeedbackRequest(BaseModel):
    """The true label of an earlier prediction."""

    prediction_id: Annotated[str, Field(max_length=64)]
    # A class index (a JSON integer: not true/false, not 1.0), or its name where the data named them.
    label: StrictInt | Annotated[str, Field(max_length=1000)]


class FeedbackResponse(BaseModel):
    """Rolling accuracy over the labelled window."""

    rolling_accuracy: float | None  # None when the prediction came from a version no longer served
    window: int  # distinct predictions of the served model labelled in the window


class StatusResponse(BaseModel):
    """Liveness or readiness."""

    status: str
    model_version: str | None = None


class ErrorResponse(BaseModel):
    """Every 4xx/5xx body."""

    error: str


ERRORS = {status: {"model": ErrorResponse} for status in (404, 408, 409, 413, 422, 500, 503)}


class Metrics:
    """The app's Prometheus metrics (own registry, `pruneops_` prefix)."""

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.latency = Histogram(
            "pruneops_inference_latency_seconds",
            "Model inference latency per request",
            ["model_version"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.requests = Counter(
            "pruneops_requests_total", "Requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        # Labelled by the served version and absent until its first label: no reading is not 0.
        self.accuracy = Gauge("pruneops_accuracy", "Rolling accuracy from feedback", ["model_version"], registry=r)
        self.accuracy_samples = Gauge(
            "pruneops_accuracy_samples",
            "Distinct labelled predictions behind pruneops_accuracy",
            ["model_version"],
            registry=r,
        )
        self.accuracy_threshold = Gauge(
            "pruneops_accuracy_threshold",
            "Accuracy alert threshold: the model's test accuracy - reprune.accuracy_tolerance - 3 standard errors",
            ["model_version"],
            registry=r,
        )
        self.feedback = Counter("pruneops_feedback_total", "Labelled feedback received", registry=r)
        self.feedback_refused = Counter(
            "pruneops_feedback_refused_total", "Feedback refused (duplicate, unknown)", ["reason"], registry=r
        )
        self.drift = Gauge("pruneops_drift_score", "Input drift (PSI) per feature group", ["group"], registry=r)
        self.drift_ks = Gauge("pruneops_drift_ks", "Input drift (KS D) per feature group", ["group"], registry=r)
        self.drift_threshold = Gauge(
            "pruneops_drift_threshold", "Alert thresholds from params.yaml", ["stat"], registry=r
        )
        self.drift_min_samples = Gauge(
            "pruneops_drift_min_samples", "Inputs needed before drift is scored (above sampling noise)", registry=r
        )
        self.drift_samples = Gauge("pruneops_drift_samples", "Inputs in the drift window", registry=r)
        self.latency_slo = Gauge("pruneops_latency_slo_seconds", "reprune.latency_slo_ms, for the alert", registry=r)
        self.prediction_drift = Gauge("pruneops_prediction_drift_psi", "Drift of predicted classes (PSI)", registry=r)
        self.model_info = Gauge(
            "pruneops_model_info", "The served model", ["version", "sparsity", "params", "macs"], registry=r
        )
        self.reload_errors = Counter("pruneops_model_reload_errors_total", "New models refused", registry=r)
        self.fallback = Gauge(
            "pruneops_model_fallback", "1 while an earlier version serves because production cannot", registry=r
        )
        self.last_reprune = Gauge(
            "pruneops_last_reprune_timestamp_seconds", "When the served model was registered", registry=r
        )
        self.last_promotion = Gauge("pruneops_last_promotion_timestamp_seconds", "Last promotion", registry=r)


class ServingState:
    """The model, the drift window, recent predictions and labelled feedback, behind one lock.

    Request handlers run in a thread pool and the watcher in another thread: every read and
    write of the shared collections goes through `self.lock`.
    """

    def __init__(self, config: ServingConfig):
        self.config = config
        self.metrics = Metrics()
        self.holder = ModelHolder(config.production, config.threads)
        fallback = config.reference_stats
        reference = read_json(fallback) if fallback is not None and fallback.exists() else None
        self.monitor = DriftMonitor(
            reference, config.drift_window, config.drift_min_samples, config.psi_threshold, config.ks_threshold
        )
        self.lock = threading.Lock()
        # prediction id -> (input, predicted class, version); a labelled id moves to `labelled_ids`.
        self.recent: OrderedDict[str, tuple[np.ndarray, int, str]] = OrderedDict()
        self.labelled_ids: OrderedDict[str, None] = OrderedDict()
        self.correct: deque[int] = deque(maxlen=config.accuracy_window)
        self.labelled: deque[tuple[np.ndarray, int]] = deque(maxlen=50_000)
        self.since_flush = 0
        self.expected_accuracy: tuple[float, int] | None = None
        self.metrics.drift_threshold.labels("psi").set(config.psi_threshold)
        self.metrics.drift_threshold.labels("ks").set(config.ks_threshold)
        self.metrics.latency_slo.set(config.latency_slo_ms / 1e3)

    def refresh(self) -> None:
        """Swaps in a newly promoted model (a refused one is counted; the old one keeps serving)."""
        errors = self.holder.reload_errors
        if self.holder.refresh():
            self.publish_model(self.holder.current)
        if self.holder.reload_errors > errors:
            self.metrics.reload_errors.inc(self.holder.reload_errors - errors)
        self.metrics.fallback.set(1 if self.holder.fallback_from else 0)

    def publish_model(self, model: ServableModel) -> None:
        """Exports what is served, and measures drift against the data this model was trained on."""
        if model.reference_stats is not None and model.reference_stats != self.monitor.reference:
            self.monitor.set_reference(model.reference_stats)
        m = model.metadata.get("metrics", {}).get("models", {}).get("pruned_deployed", {})
        self.metrics.model_info.clear()
        self.metrics.model_info.labels(
            model.version, str(model.metadata.get("sparsity", "")), str(m.get("params", "")), str(m.get("macs", ""))
        ).set(1)
        self.metrics.last_reprune.set(model.metadata.get("registered_at", 0))
        with self.lock:  # the rolling accuracy is the served model's own: a new one starts empty
            self.correct.clear()
            self.expected_accuracy = expected_accuracy(model.metadata)
        for gauge in (self.metrics.accuracy, self.metrics.accuracy_samples, self.metrics.accuracy_threshold):
            gauge.clear()
        self.metrics.drift_min_samples.set(self.monitor.min_samples)
        with contextlib.suppress(RegistryError, IndexError, KeyError):
            self.metrics.last_promotion.set(ModelRegistry(self.config.production.parent).history()[-1]["at"])

    def predict(self, model: ServableModel, x: np.ndarray | dict, texts: list[str] | None = None) -> PredictResponse:
        """Runs the model, tracks latency and drift, and remembers each input for feedback.

        Args:
            model: The served model.
            x: The batch (an array, or a text model's named feed).
            texts: The raw texts of a text batch: drift is measured on them and feedback keeps them.
        """
        started = time.perf_counter()
        probs = model.predict_proba(x)
        self.metrics.latency.labels(model.version).observe(time.perf_counter() - started)
        classes = probs.argmax(axis=1)
        self.monitor.observe(model.encoder.drift_features(x) if texts is not None else x, classes)
        kept = texts if texts is not None else x
        ids = [uuid.uuid4().hex for _ in range(len(kept))]
        with self.lock:
            for pid, xi, ci in zip(ids, kept, classes, strict=True):
                self.recent[pid] = (xi, int(ci), model.version)
            while len(self.recent) > self.prediction_cache:
                self.recent.popitem(last=False)
        names = model.metadata.get("input", {}).get("class_names")
        return PredictResponse(
            prediction_ids=ids,
            classes=classes.tolist(),
            probabilities=probs.round(6).tolist(),
            model_version=model.version,
            class_names=[names[c] if c < len(names) else str(c) for c in classes] if names else None,
        )

    @property
    def prediction_cache(self) -> int:
        """How many recent predictions accept feedback (older ids expire)."""
        return 10 * self.config.drift_window

    def feedback(self, prediction_id: str, label: int, served: str | None) -> FeedbackResponse:
        """Records the one true label of a prediction; every `feedback_flush_every` labels the store is written.

        A label counts towards the rolling accuracy of the version that made the prediction while
        it is served; it is kept for re-pruning whichever version made it.

        Raises:
            HTTPException: 404 for an unknown or expired id, 409 for an id already labelled.
        """
        with self.lock:
            item = self.recent.pop(prediction_id, None)
            if item is None:
                duplicate = prediction_id in self.labelled_ids
                self.metrics.feedback_refused.labels("duplicate" if duplicate else "unknown").inc()
                if duplicate:
                    raise HTTPException(409, "this prediction_id is already labelled: a prediction takes one label")
                raise HTTPException(404, f"unknown or expired prediction_id {prediction_id[:64]!r}")
            self.labelled_ids[prediction_id] = None
            while len(self.labelled_ids) > self.prediction_cache:
                self.labelled_ids.popitem(last=False)
            x, predicted, version = item
            if version == served:
                self.correct.append(int(predicted == label))
            self.labelled.append((x, label))
            self.since_flush += 1
            due = self.since_flush >= self.config.feedback_flush_every
            window = len(self.correct)
            accuracy = sum(self.correct) / window if window else None
        if due:
            self.flush_feedback()
        self.metrics.feedback.inc()
        if accuracy is not None and served is not None:
            self._export_accuracy(served, accuracy, window)
        return FeedbackResponse(rolling_accuracy=accuracy, window=window)

    def _export_accuracy(self, version: str, accuracy: float, window: int) -> None:
        self.metrics.accuracy.labels(version).set(accuracy)
        self.metrics.accuracy_samples.labels(version).set(window)
        threshold = accuracy_threshold(self.expected_accuracy, window, self.config.accuracy_tolerance)
        if threshold is not None:
            self.metrics.accuracy_threshold.labels(version).set(threshold)

    def flush_feedback(self) -> None:
        """Writes the labelled samples where `reprune` looks for them (NPZ, 80/20 split).

        Texts go to a CSV beside it (`text`, `label` columns, label names where the model has
        them): the input of `validate.dataset: text`.
        """
        path = self.config.feedback_path
        with self.lock:
            if path is None or not self.labelled:
                return
            if isinstance(self.labelled[0][0], str):
                self._flush_texts(path.with_suffix(".csv"))
                return
            x = np.stack([item[0] for item in self.labelled])
            y = np.array([item[1] for item in self.labelled], dtype=np.int64)
            self.since_flush = 0
        cut = max(1, int(0.8 * len(y)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp.npz")
        np.savez(tmp, x_train=x[:cut], y_train=y[:cut], x_test=x[cut:], y_test=y[cut:])
        os.replace(tmp, path)

    def _flush_texts(self, path: Path) -> None:
        """Writes labelled texts as CSV (called under `self.lock`)."""
        import csv
        import io

        model = self.holder.current
        names = (model.metadata.get("input", {}).get("class_names") if model else None) or []
        out = io.StringIO()
        writer = csv.writer(out)
        writer.writerow(["text", "label"])
        for text, label in self.labelled:
            writer.writerow([text, names[label] if label < len(names) else label])
        self.since_flush = 0
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.{threading.get_ident()}.tmp")
        tmp.write_text(out.getvalue(), encoding="utf-8")
        os.replace(tmp, path)

    def export_drift(self) -> None:
        """Sets the drift gauges from the current window (nothing below `drift_min_samples`)."""
        self.metrics.drift_samples.set(self.monitor.samples)
        scores = self.monitor.scores()
        if scores is None:
            return
        for group, value in scores.psi_by_group.items():
            self.metrics.drift.labels(group).set(value)
        for group, value in scores.ks_by_group.items():
            self.metrics.drift_ks.labels(group).set(value)
        self.metrics.drift.labels("overall").set(scores.psi_overall)
        self.metrics.drift_ks.labels("overall").set(scores.ks_overall)
        self.metrics.prediction_drift.set(scores.prediction_psi)


def _endpoint(request: Request) -> str:
    name = request.url.path.strip("/")
    return name if name in KNOWN_ENDPOINTS else "other"


def _install_handlers(app: FastAPI, state: ServingState) -> None:
    """Error bodies, the body-size cap and the one place HTTP responses are counted."""
    app.add_middleware(BodyLimit, limit=state.config.max_body_bytes)

    @app.middleware("http")  # added after BodyLimit, so outside it: its 413s are counted too
    async def count(request: Request, call_next):
        response = await _answered(request, call_next)
        state.metrics.requests.labels(_endpoint(request), str(response.status_code)).inc()
        return response

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        return JSONResponse(
            {"error": f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}"}, status_code=422
        )


async def _answered(request: Request, call_next) -> Response:
    """The endpoint's response, or a 500 for an unhandled error (so that it is counted)."""
    try:
        return await call_next(request)
    except Exception as exc:  # noqa: BLE001 - counted and answered; the log keeps the traceback
        log.exception("unhandled error on %s: %s", request.url.path, exc)
        return JSONResponse({"error": f"internal error: {type(exc).__name__}"}, status_code=500)


def _install_routes(app: FastAPI, state: ServingState) -> None:
    @app.post("/predict", responses=ERRORS)
    def predict(body: PredictRequest) -> PredictResponse:
        model = state.holder.current
        if model is None:
            raise HTTPException(
                503, "no model is being served yet: publish one with `pruneops publish` (after `dvc repro`)"
            )
        return state.predict(model, parse_inputs(body, model, state.config.max_batch), body.texts)

    @app.post("/feedback", responses=ERRORS)
    def feedback(body: FeedbackRequest) -> FeedbackResponse:
        served = state.holder.current
        return state.feedback(body.prediction_id, feedback_label(body.label, served), served and served.version)

    @app.get("/healthz")
    def healthz() -> StatusResponse:
        return StatusResponse(status="ok")

    @app.get("/readyz", responses=ERRORS)
    def readyz() -> StatusResponse:
        if state.holder.current is None:
            raise HTTPException(503, "no model")
        return StatusResponse(status="ready", model_version=state.holder.current.version)

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        state.export_drift()
        return Response(generate_latest(state.metrics.registry), media_type=CONTENT_TYPE_LATEST)


async def watch_production(state: ServingState) -> None:
    """Checks for a promotion every `reload_interval_s`; no error ends the loop."""
    while True:
        await asyncio.sleep(state.config.reload_interval_s)
        try:
            await asyncio.to_thread(state.refresh)
        except Exception:  # noqa: BLE001 - the watcher must outlive any bad model
            state.metrics.reload_errors.inc()
            log.exception("model reload failed; still serving %s", getattr(state.holder.current, "version", None))


def create_app(config: ServingConfig | None = None) -> FastAPI:
    """Builds the serving app (the model loads at start-up and on promotion)."""
    state = ServingState(config or ServingConfig())

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        state.refresh()
        task = asyncio.create_task(watch_production(state))
        yield
        task.cancel()
        state.flush_feedback()

    app = FastAPI(title="PruneOps serving", lifespan=lifespan)
    app.state.serving = state
    app.state.monitor, app.state.refresh = state.monitor, state.refresh
    _install_handlers(app, state)
    _install_routes(app, state)
    return app


def app_from_params(
    root: Path,
    params_file: str | Path = "params.yaml",
    registry_dir: str | None = None,
    *,
    reload_interval_s: float | None = None,
    reference: str | None = None,
) -> FastAPI:
    """The serving app of a project, configured by its `serve` and `reprune` params sections.

    Raises:
        ConfigError: Invalid params.
    """
    from pruneops.core.params import read_params
    from pruneops.pipeline.stages import load_configs

    configs = load_configs(read_params(Path(root) / params_file), ("serve", "reprune"))
    serve, reprune = configs["serve"], configs["reprune"]
    settings = serve.model_dump()
    if reload_interval_s is not None:
        if not reload_interval_s > 0:
            raise ConfigError(f"--reload-interval: must be greater than 0 (got {reload_interval_s})")
        settings["reload_interval_s"] = reload_interval_s
    registry = Path(root) / (registry_dir or reprune.registry_dir)
    return create_app(
        ServingConfig(
            production=registry / "production",
            reference_stats=Path(reference) if reference else pipeline_reference_stats(Layout(Path(root))),
            feedback_path=Path(root) / reprune.feedback_dir / "feedback.npz",
            accuracy_tolerance=reprune.accuracy_tolerance,
            latency_slo_ms=reprune.latency_slo_ms,
            **settings,
        )
    )
