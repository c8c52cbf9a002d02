"""FastAPI app: /predict, /feedback, /healthz, /readyz, /metrics over the production model."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
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
from pydantic import BaseModel, ConfigDict, Field

from pruneops.drift import DriftMonitor
from pruneops.io import read_json
from pruneops.serving.model import ModelHolder

log = logging.getLogger("pruneops.serving")

# Millisecond-scale inference: buckets from 50 us to 1 s.
LATENCY_BUCKETS = (5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 1.0)


class ServingConfig(BaseModel):
    """How the app serves: where the model and reference statistics are, window sizes."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    production: Path = Path("models/production")
    # Used until a model that carries its own reference statistics is loaded.
    reference_stats: Path | None = Path("artifacts/validate/reference_stats.json")
    drift_window: Annotated[int, Field(ge=10)] = 1000
    drift_min_samples: Annotated[int, Field(ge=1)] = 50
    psi_threshold: Annotated[float, Field(gt=0)] = 0.2
    ks_threshold: Annotated[float, Field(gt=0)] = 0.3
    feedback_path: Path | None = None
    feedback_flush_every: Annotated[int, Field(ge=1)] = 100
    accuracy_window: Annotated[int, Field(ge=1)] = 500
    max_batch: Annotated[int, Field(ge=1)] = 256
    reload_interval_s: Annotated[float, Field(gt=0)] = 2.0
    threads: Annotated[int, Field(ge=1)] = 1


class PredictRequest(BaseModel):
    """A batch of inputs, each shaped like one model input (nested lists)."""

    inputs: list


class FeedbackRequest(BaseModel):
    """The true label of an earlier prediction."""

    prediction_id: str
    label: int


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
        self.accuracy = Gauge("pruneops_accuracy", "Rolling accuracy from feedback", registry=r)
        self.feedback = Counter("pruneops_feedback_total", "Labelled feedback received", registry=r)
        self.drift = Gauge("pruneops_drift_score", "Input drift (PSI) per feature group", ["group"], registry=r)
        self.drift_ks = Gauge("pruneops_drift_ks", "Input drift (KS D) per feature group", ["group"], registry=r)
        self.drift_threshold = Gauge(
            "pruneops_drift_threshold", "Alert thresholds from params.yaml", ["stat"], registry=r
        )
        self.prediction_drift = Gauge("pruneops_prediction_drift_psi", "Drift of predicted classes (PSI)", registry=r)
        self.model_info = Gauge(
            "pruneops_model_info", "The served model", ["version", "sparsity", "params", "macs"], registry=r
        )
        self.reload_errors = Counter("pruneops_model_reload_errors_total", "New models refused", registry=r)
        self.last_reprune = Gauge(
            "pruneops_last_reprune_timestamp_seconds", "When the served model was registered", registry=r
        )
        self.last_promotion = Gauge("pruneops_last_promotion_timestamp_seconds", "Last promotion", registry=r)


def create_app(config: ServingConfig | None = None) -> FastAPI:
    """Builds the serving app (the model loads at start-up and on promotion)."""
    config = config or ServingConfig()
    metrics = Metrics()
    holder = ModelHolder(config.production, config.threads)
    fallback = config.reference_stats
    reference = read_json(fallback) if fallback is not None and fallback.exists() else None
    monitor = DriftMonitor(reference, config.drift_window, config.drift_min_samples)
    recent: OrderedDict[str, tuple[np.ndarray, int]] = OrderedDict()
    correct: deque[int] = deque(maxlen=config.accuracy_window)
    labelled: deque[tuple[np.ndarray, int]] = deque(maxlen=50_000)

    def publish_model() -> None:
        model = holder.current
        if model is None:
            return
        if model.reference_stats is not None and model.reference_stats != monitor.reference:
            monitor.set_reference(model.reference_stats)
        metrics.model_info.clear()
        m = model.metadata.get("metrics", {}).get("models", {}).get("pruned_int8", {})
        metrics.model_info.labels(
            model.version, str(model.metadata.get("sparsity", "")), str(m.get("params", "")), str(m.get("macs", ""))
        ).set(1)
        metrics.last_reprune.set(model.metadata.get("registered_at", 0))
        history = config.production.parent / "history.json"
        if history.exists():
            promotions = [e["at"] for e in read_json(history) if e["action"] in ("promote", "rollback")]
            if promotions:
                metrics.last_promotion.set(promotions[-1])

    def refresh() -> None:
        errors = holder.reload_errors
        if holder.refresh():
            publish_model()
        if holder.reload_errors > errors:
            metrics.reload_errors.inc(holder.reload_errors - errors)

    async def watch() -> None:
        while True:
            await asyncio.sleep(config.reload_interval_s)
            await asyncio.to_thread(refresh)

    @contextlib.asynccontextmanager
    async def lifespan(_: FastAPI):
        refresh()
        task = asyncio.create_task(watch())
        yield
        task.cancel()
        flush_feedback()

    metrics.drift_threshold.labels("psi").set(config.psi_threshold)
    metrics.drift_threshold.labels("ks").set(config.ks_threshold)
    since_flush = [0]

    def flush_feedback() -> None:
        """Writes the labelled samples where `reprune` looks for them (NPZ, 80/20 split)."""
        if config.feedback_path is None or not labelled:
            return
        x = np.stack([item[0] for item in labelled])
        y = np.array([item[1] for item in labelled], dtype=np.int64)
        cut = max(1, int(0.8 * len(y)))
        config.feedback_path.parent.mkdir(parents=True, exist_ok=True)
        tmp = config.feedback_path.with_suffix(".tmp.npz")
        np.savez(tmp, x_train=x[:cut], y_train=y[:cut], x_test=x[cut:], y_test=y[cut:])
        os.replace(tmp, config.feedback_path)
        since_flush[0] = 0

    app = FastAPI(title="PruneOps serving", lifespan=lifespan)
    app.state.holder, app.state.metrics, app.state.monitor, app.state.labelled = holder, metrics, monitor, labelled
    app.state.refresh = refresh

    def fail(endpoint: str, status: int, message: str):
        metrics.requests.labels(endpoint, str(status)).inc()
        raise HTTPException(status_code=status, detail=message)

    @app.exception_handler(HTTPException)
    async def http_error(_: Request, exc: HTTPException) -> JSONResponse:
        return JSONResponse({"error": exc.detail}, status_code=exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def bad_request(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        where = ".".join(str(p) for p in first.get("loc", ()) if p != "body")
        metrics.requests.labels(request.url.path.strip("/"), "422").inc()
        return JSONResponse(
            {"error": f"invalid request: {where or 'body'}: {first.get('msg', 'malformed')}"}, status_code=422
        )

    @app.post("/predict")
    def predict(body: PredictRequest) -> dict:
        model = holder.current
        if model is None:
            fail("predict", 503, "no model is being served yet")
        try:
            x = np.asarray(body.inputs, dtype=np.float32)
        except (ValueError, TypeError):
            fail("predict", 422, "inputs must be a (nested) list of numbers with a regular shape")
        if x.ndim == len(model.input_shape):
            x = x[None]
        if x.shape[1:] != model.input_shape:
            fail("predict", 422, f"each input must have shape {list(model.input_shape)}, got {list(x.shape[1:])}")
        if not 1 <= len(x) <= config.max_batch:
            fail("predict", 422, f"batch size must be 1..{config.max_batch}, got {len(x)}")
        if not np.isfinite(x).all():
            fail("predict", 422, "inputs must be finite (no NaN or infinity)")
        started = time.perf_counter()
        probs = model.predict_proba(x)
        metrics.latency.labels(model.version).observe(time.perf_counter() - started)
        classes = probs.argmax(axis=1)
        monitor.observe(x, classes)
        ids = [uuid.uuid4().hex for _ in range(len(x))]
        for pid, xi, ci in zip(ids, x, classes, strict=True):
            recent[pid] = (xi, int(ci))
            if len(recent) > 10 * config.drift_window:
                recent.popitem(last=False)
        metrics.requests.labels("predict", "200").inc()
        return {
            "prediction_ids": ids,
            "classes": classes.tolist(),
            "probabilities": probs.round(6).tolist(),
            "model_version": model.version,
        }

    @app.post("/feedback")
    def feedback(body: FeedbackRequest) -> dict:
        item = recent.get(body.prediction_id)
        if item is None:
            fail("feedback", 404, f"unknown or expired prediction_id {body.prediction_id!r}")
        x, predicted = item
        correct.append(int(predicted == body.label))
        labelled.append((x, body.label))
        since_flush[0] += 1
        if since_flush[0] >= config.feedback_flush_every:
            flush_feedback()
        metrics.accuracy.set(sum(correct) / len(correct))
        metrics.feedback.inc()
        metrics.requests.labels("feedback", "200").inc()
        return {"rolling_accuracy": sum(correct) / len(correct), "window": len(correct)}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok"}

    @app.get("/readyz")
    def readyz():
        if holder.current is None:
            return JSONResponse({"status": "no model"}, status_code=503)
        return {"status": "ready", "model_version": holder.current.version}

    @app.get("/metrics")
    def prometheus_metrics() -> Response:
        scores = monitor.scores()
        if scores is not None:
            for group, value in scores.psi_by_group.items():
                metrics.drift.labels(group).set(value)
            for group, value in scores.ks_by_group.items():
                metrics.drift_ks.labels(group).set(value)
            metrics.drift.labels("overall").set(scores.psi_overall)
            metrics.drift_ks.labels("overall").set(scores.ks_overall)
            metrics.prediction_drift.set(scores.prediction_psi)
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    return app
