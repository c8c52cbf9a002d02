"""Torch-free serving of a decoder LLM: the OpenAI API (/v1), /generate, /feedback, /healthz and /metrics.

The model is an export folder of a decoder runtime (onnxruntime-genai's, or a GGUF folder llama.cpp
serves; what the export stage writes, found by `pruneops.runtimes.runtime_of`). Generations run in
a scheduler (`pruneops.serving.scheduler`): a bounded queue (429 with Retry-After beyond it) and one
worker that steps every running generation a token per turn, so a request is never held behind a
whole generation, and one whose client hung up ends within a token. Each decodes with the KV cache,
greedy or seeded sampling, and stops at end-of-sequence, its token limit or its deadline. Prompts
are bounded by the model's context and by what their prefill costs (`ServeLimits`). Every request
is timed where it runs: time to first token (prefill and the first step) and time per further
output token go to Prometheus histograms, beside generated-token counters and requests by status.
With `"stream": true` /generate sends the tokens as server-sent events as they are decoded (`token`
events, then one `done` event with what the plain answer holds); the OpenAI endpoints stream in
OpenAI's chunk format (`pruneops.serving.openai_api`). Prompts are watched for drift: the frequency
of the reference corpus's most common tokens (and all others as one bin) in the recent prompts'
tokens, as a PSI, published once the window holds enough tokens to be above sampling noise.
`/feedback` takes a prompt and a reference continuation and feeds a rolling perplexity gauge, once
per distinct pair, scored by the served model's own logits (in its runtime, prefill with an empty
cache). A promoted version that fails to load is counted and refused; the served model keeps
serving. Needs the `llm` and `serve` extras.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from pruneops.serving.decoder_service import (
    CLIENT_GONE,
    BadPrompt,
    ContextOverflow,
    DecoderMetrics,
    DecoderService,
    EmptyText,
    FeedbackRequest,
    GenerateRequest,
    GenerateResponse,
    ServeLimits,
    generate_response,
    sampling_of,
)
from pruneops.serving.limits import BodyLimit
from pruneops.serving.openai_api import error_body, install_openai_routes
from pruneops.serving.scheduler import QueueFull
from pruneops.serving.streaming import Ended, JobOutput, pieces

__all__ = ["DecoderService", "EmptyText", "GenerateRequest", "ServeLimits", "create_decoder_app", "follow_production"]

ENDPOINTS = ("generate", "feedback", "healthz", "metrics", "v1/completions", "v1/chat/completions", "v1/models")
MAX_BODY_BYTES = 1_000_000  # a request body over this is refused (413) before it is parsed
log = logging.getLogger(__name__)


def _event(name: str, data: dict) -> str:
    """One server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


async def _generate_events(stream: AsyncIterator, tokenizer: object) -> AsyncIterator[str]:
    """/generate's stream: a `token` event per piece, then `done` (what the plain answer holds) or `error`."""
    async for item in stream:
        if not isinstance(item, Ended):
            yield _event("token", {"tokens": item[0], "text": item[1]})
        elif item.finished.reason == "error":
            yield _event("error", {"detail": f"generation failed: {item.finished.error}"})
        else:
            text = tokenizer.decode(item.finished.tokens, skip_special_tokens=True)
            yield _event("done", generate_response(item.finished, text).model_dump())


def _endpoint(path: str) -> str:
    name = path.strip("/")
    return name if name in ENDPOINTS else "other"


class CountResponses:
    """ASGI middleware: every response counted by endpoint and status; an unhandled error answered 500.

    Pure ASGI, not `@app.middleware("http")`: Starlette's `BaseHTTPMiddleware` hides a client's
    disconnect from the endpoint (`request.is_disconnected()` stays False), which would keep an
    abandoned generation running.
    """

    def __init__(self, app: Callable, metrics: DecoderMetrics):
        self.app, self.metrics = app, metrics

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = None

        async def counted(message: dict) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, counted)
        except Exception as exc:  # noqa: BLE001 - counted and answered; the log keeps the traceback
            log.exception("unhandled error on %s: %s", scope.get("path"), exc)
            if status is None:
                status = 500
                body = json.dumps({"detail": f"internal error: {type(exc).__name__}"}).encode()
                await send({"type": "http.response.start", "status": 500,
                            "headers": [(b"content-type", b"application/json")]})  # fmt: skip
                await send({"type": "http.response.body", "body": body})
        finally:
            self.metrics.requests.labels(_endpoint(scope.get("path", "")), str(status or CLIENT_GONE)).inc()


def install_errors(app: FastAPI, metrics: DecoderMetrics, max_body_bytes: int) -> None:
    """The body cap, every response counted by endpoint and status, and error bodies that echo no input.

    /v1 paths answer in the OpenAI API's error shape (`openai_api.error_body`); the others with
    `{"detail": ...}`. A request that fails validation gets 422 (400 on /v1) naming the field and
    the rule, never the value sent (a 200 MB prompt is not sent back; NaN cannot break the answer).
    """
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse
    from starlette.exceptions import HTTPException as StarletteHTTPException

    app.add_middleware(BodyLimit, limit=max_body_bytes)
    app.add_middleware(CountResponses, metrics=metrics)  # added after BodyLimit, so outside it: 413s counted

    def body(request: Request, status: int, message: str, param: str | None = None) -> JSONResponse:
        headers = {}
        if request.url.path.startswith("/v1/"):
            return JSONResponse(error_body(status, message, param), status_code=status, headers=headers)
        return JSONResponse({"detail": message}, status_code=status, headers=headers)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        response = body(request, exc.status_code, str(exc.detail))
        response.headers.update(exc.headers or {})
        return response

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {}
        # The field's path, without the body and pydantic's union tags (`constrained-str`, `list[str]`).
        loc = [p for p in first.get("loc", ()) if p != "body" and (isinstance(p, int) or p.isidentifier())]
        where = ".".join(map(str, loc))
        message = f"invalid request: {where or 'body'}: {str(first.get('msg', 'malformed'))[:200]}"
        status = 400 if request.url.path.startswith("/v1/") else 422
        return body(request, status, message, where or None)


def refusal(exc: Exception) -> HTTPException:
    """The HTTP answer to a request the server will not run: 4xx, or 429 with Retry-After."""
    if isinstance(exc, QueueFull):
        return HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)})
    if isinstance(exc, ContextOverflow):
        return HTTPException(400, str(exc))
    if isinstance(exc, BadPrompt):
        return HTTPException(422, str(exc))
    raise exc


async def finished_job(stream: AsyncIterator) -> Ended | None:
    """A job's end (None: the client left first and the job was cancelled)."""
    ended = None
    async for item in stream:
        if isinstance(item, Ended):
            ended = item
    return ended


def create_decoder_app(service: DecoderService, served_name: str | None = None) -> FastAPI:
    """The FastAPI app over a loaded `DecoderService`: /generate and the OpenAI API (/v1), /feedback, /metrics.

    Args:
        service: The loaded service.
        served_name: The model id the OpenAI API lists and takes (default: the served folder's name).
    """
    app = FastAPI(title="PruneOps decoder serving")
    m = service.metrics
    install_errors(app, m, MAX_BODY_BYTES)

    @app.post("/generate", response_model=GenerateResponse)
    async def generate(body: GenerateRequest, request: Request) -> GenerateResponse | StreamingResponse | Response:
        output = JobOutput()
        try:
            sampling = sampling_of(body, service.vocab)
            job = service.submit(service.prompt_ids(body), body.max_new_tokens, sampling, output)
        except (BadPrompt, QueueFull) as exc:
            raise refusal(exc) from None
        stream = pieces(job, output, service.tokenizer, (), request.is_disconnected)
        if body.stream:
            return StreamingResponse(_generate_events(stream, service.tokenizer), media_type="text/event-stream")
        ended = await finished_job(stream)
        if ended is None:
            return Response(status_code=CLIENT_GONE)
        if ended.finished.reason == "error":
            raise HTTPException(500, f"generation failed: {ended.finished.error}")
        return generate_response(ended.finished, service.decode(ended.finished.tokens))

    @app.post("/feedback")
    def feedback(body: FeedbackRequest) -> dict:
        try:
            return service.score(body)
        except BadPrompt as exc:
            raise refusal(exc) from None

    @app.get("/healthz")
    def healthz() -> dict:
        running, waiting = service.scheduler.load()
        return {
            "status": "ok",
            "model": str(service.folder),
            "version": service.metrics.version,
            "running": running,
            "waiting": waiting,
            "max_prompt_tokens": service.max_prompt_tokens,
            "fallback_from": service.fallback_from,  # production, where an earlier version is served instead
        }

    @app.get("/metrics")
    def metrics() -> Response:
        running, waiting = service.scheduler.load()
        m.running.set(running)
        m.waiting.set(waiting)
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

    install_openai_routes(app, service, served_name or Path(service.folder).name)
    return app


def follow_production(service: DecoderService, registry_dir: Path, interval_s: float) -> threading.Thread:
    """Polls the registry's production link and swaps the service onto each newly promoted version."""

    def current() -> Path | None:
        link = Path(registry_dir) / "production"
        return link.resolve() if link.exists() else None

    refused: set[Path] = set()  # a version that failed to load is not retried every interval

    def loop() -> None:
        while True:
            time.sleep(interval_s)
            target = current()
            if target is None or target == service.folder.resolve() or target in refused:
                continue
            reference = target / "reference_stats.json"
            try:
                stats = json.loads(reference.read_text()) if reference.is_file() else None
            except (OSError, ValueError) as exc:
                stats = None
                log.warning("serve-decoder: %s has an unreadable drift reference: %s", target.name, exc)
            if not service.swap(target, stats):
                refused.add(target)

    thread = threading.Thread(target=loop, name="follow-production", daemon=True)
    thread.start()
    return thread
