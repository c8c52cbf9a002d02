"""Torch-free serving of a decoder LLM: /generate, /feedback, /healthz and /metrics.

The model is an export folder of a decoder runtime (onnxruntime-genai's, or a GGUF folder llama.cpp
serves; what the export stage writes, found by `pruneops.runtimes.runtime_of`): its generator
decodes with the KV cache, greedy or seeded sampling, and stops at end-of-sequence or
`max_new_tokens`. Every request is timed where it runs: time to first token (prefill and the
first step) and time per further output token go to Prometheus histograms, beside generated-token
counters and requests by status. With `"stream": true` the tokens arrive as server-sent events as
they are decoded (`token` events, then one `done` event with what the plain answer holds).
Prompts are watched for drift: the frequency of the reference corpus's most common tokens (and
all others as one bin) in the recent prompts' tokens, as a PSI, published once the window holds
enough tokens to be above sampling noise. `/feedback` takes a prompt and a reference continuation
and feeds a rolling perplexity gauge, scored by the served model's own logits (in its runtime,
prefill with an empty cache). A promoted version that fails to load is counted and refused; the
served model keeps serving. Needs the `llm` and `serve` extras.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Annotated

import numpy as np
from fastapi import FastAPI, HTTPException
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field

from pruneops.core.errors import ConfigError, PruneOpsError
from pruneops.data.corpus import affixes_of
from pruneops.data.drift import psi
from pruneops.runtimes import runtime_of

TOKEN_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2, 7.5e-2, 0.1, 0.15, 0.25, 0.5, 1.0)
FIRST_TOKEN_BUCKETS = (1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ENDPOINTS = ("generate", "feedback", "healthz", "metrics")
MIN_TOKENS_PER_BIN = 20  # prompt drift is published once the window holds this many tokens per bin
log = logging.getLogger(__name__)


class EmptyText(ValueError):
    """A prompt or continuation that holds no token of the model's vocabulary."""


class GenerateRequest(BaseModel):
    """A prompt and how to continue it."""

    model_config = ConfigDict(extra="forbid")
    prompt: Annotated[str, Field(min_length=1, max_length=100_000)]
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    do_sample: bool = False
    temperature: Annotated[float, Field(gt=0.0, le=10.0)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=100_000)] = 50
    top_p: Annotated[float, Field(gt=0.0, le=1.0)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    stream: bool = False  # server-sent events, one per token, then `done`


class GenerateResponse(BaseModel):
    """The continuation and what it cost."""

    text: str
    tokens: int
    finish_reason: str  # eos | length
    ttft_ms: float
    tpot_ms: float | None


class FeedbackRequest(BaseModel):
    """A prompt and the continuation it should have had (a reference answer)."""

    model_config = ConfigDict(extra="forbid")
    prompt: Annotated[str, Field(min_length=1, max_length=100_000)]
    continuation: Annotated[str, Field(min_length=1, max_length=100_000)]


class PromptDrift:
    """Token-frequency PSI of the last `window` prompt tokens against the reference."""

    def __init__(self, reference: dict, window: int):
        self.index = {t: i for i, t in enumerate(reference["tokens"])}
        self.expected = np.asarray(reference["shares"], dtype=float)
        self.recent: deque[int] = deque(maxlen=window)
        self.min_tokens = MIN_TOKENS_PER_BIN * len(self.expected)

    def add(self, tokens: list[int]) -> float | None:
        """Adds a prompt's tokens; returns the PSI once the window holds `min_tokens`, else None."""
        other = len(self.expected) - 1
        self.recent.extend(self.index.get(t, other) for t in tokens)
        if len(self.recent) < self.min_tokens:
            return None
        actual = np.bincount(np.fromiter(self.recent, dtype=np.int64), minlength=len(self.expected)) / len(self.recent)
        return float(psi(self.expected[None, :], actual[None, :])[0])


class DecoderMetrics:
    """Prometheus metrics of the decoder app (own registry, `pruneops_` prefix)."""

    def __init__(
        self,
        version: str,
        psi_threshold: float = 0.2,
        decode_slo_ms: float | None = None,
        prefill_slo_ms: float | None = None,
    ) -> None:
        r = self.registry = CollectorRegistry()
        self.version = version
        # reprune.decode_slo_ms and reprune.prefill_slo_ms: the latency alerts' thresholds (absent when null).
        for name, slo_ms in (("decode", decode_slo_ms), ("prefill", prefill_slo_ms)):
            if slo_ms is not None:
                Gauge(f"pruneops_{name}_slo_seconds", f"reprune.{name}_slo_ms, for the alert", registry=r).set(
                    slo_ms / 1e3
                )
        self.info = Gauge("pruneops_model_info", "The model served (1)", ["model_version"], registry=r)
        self.info.labels(version).set(1)
        self.reload_errors = Counter("pruneops_model_reload_errors_total", "Promoted models refused", registry=r)
        # What the prompt-drift alert compares against (serve.psi_threshold).
        Gauge("pruneops_drift_threshold", "Drift above this alerts", ["stat"], registry=r).labels("psi").set(
            psi_threshold
        )
        self.requests = Counter(
            "pruneops_requests_total", "Requests by endpoint and status", ["endpoint", "status"], registry=r
        )
        self.ttft = Histogram(
            "pruneops_time_to_first_token_seconds", "Prefill and first token", buckets=FIRST_TOKEN_BUCKETS, registry=r
        )
        self.tpot = Histogram(
            "pruneops_time_per_output_token_seconds", "Each further generated token", buckets=TOKEN_BUCKETS, registry=r
        )
        self.generated = Counter("pruneops_generated_tokens_total", "Tokens generated", registry=r)
        self.prompt_tokens = Counter("pruneops_prompt_tokens_total", "Prompt tokens received", registry=r)
        # Labelled by the served model and absent until measured: no reading is not 0.
        self.drift = Gauge(
            "pruneops_prompt_drift_psi", "Token-frequency PSI of recent prompts", ["model_version"], registry=r
        )
        self.perplexity = Gauge(
            "pruneops_feedback_perplexity",
            "Rolling perplexity of reference continuations",
            ["model_version"],
            registry=r,
        )
        self.feedback_tokens = Gauge(
            "pruneops_feedback_tokens", "Tokens behind pruneops_feedback_perplexity", ["model_version"], registry=r
        )


class DecoderService:
    """The generator, its tokenizer, the scorer and the rolling windows, behind one lock."""

    def __init__(
        self,
        folder: Path,
        reference: dict | None,
        drift_window: int = 20_000,
        feedback_window: int = 50_000,
        feedback_file: Path | None = None,
        psi_threshold: float = 0.2,
        decode_slo_ms: float | None = None,
        prefill_slo_ms: float | None = None,
    ):
        self.metrics = DecoderMetrics(Path(folder).name, psi_threshold, decode_slo_ms, prefill_slo_ms)
        self.drift_window = drift_window
        self.feedback: deque[float] = deque(maxlen=feedback_window)
        self.feedback_file = Path(feedback_file) if feedback_file else None
        self.lock = threading.Lock()
        self._load(Path(folder), reference)

    def _load(self, folder: Path, reference: dict | None) -> None:
        """Loads everything first, then switches: a folder that fails to load leaves the service as it was."""
        from tokenizers import Tokenizer

        try:
            model = runtime_of(folder, "causal_lm").open(folder).load()
        except PruneOpsError as exc:
            raise ConfigError(f"serve-decoder: {exc}") from None
        tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        self.folder, self.model, self.vocab, self.tokenizer = folder, model, model.vocab_size, tokenizer
        # The ids the tokenizer puts before a text of its own accord (a BOS): every prompt starts with them.
        self.prefix = list(affixes_of(lambda t, special: tokenizer.encode(t, add_special_tokens=special).ids).prefix)
        self.drift = PromptDrift(reference, self.drift_window) if reference else None
        self.metrics.version = folder.name

    def swap(self, folder: Path, reference: dict | None) -> bool:
        """Serves another model folder from the next request on (a promotion); its windows start empty.

        Returns:
            Whether it swapped: a folder that does not load is counted
            (`pruneops_model_reload_errors_total`), logged, and the current model keeps serving.
        """
        with self.lock:
            old = self.metrics.version
            try:
                self._load(Path(folder), reference)
            except Exception as exc:  # noqa: BLE001 - any load failure keeps the served model
                self.metrics.reload_errors.inc()
                log.error("serve-decoder: kept %s; %s did not load: %s", old, folder, str(exc)[:300])
                return False
            self.feedback.clear()
            for gauge in (self.metrics.drift, self.metrics.perplexity, self.metrics.feedback_tokens, self.metrics.info):
                with contextlib.suppress(KeyError):  # a reading of the old model is no reading of this one
                    gauge.remove(old)
            self.metrics.info.labels(self.metrics.version).set(1)
            return True

    def watch_prompts(self, reference: dict) -> None:
        """Measures prompt drift against `reference` (from `prompt_reference`) from now on."""
        self.drift = PromptDrift(reference, self.drift_window)

    def encode(self, text: str) -> list[int]:
        """Token ids of a text (no special tokens added)."""
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def decode(self, ids: list[int]) -> str:
        """Text of token ids, special tokens left out."""
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """The prompt's token ids after the tokenizer's own prefix (its BOS), as the corpus blocks start.

        Raises:
            EmptyText: The prompt holds no token.
        """
        prompt = self.encode(request.prompt)
        if not prompt:
            raise EmptyText("the prompt holds no tokens")
        return [*self.prefix, *prompt]

    def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Decodes one continuation, timing its first and every further token."""
        return self._decode(self.prompt_ids(request), request, None)

    def stream(self, request: GenerateRequest) -> Iterator[str]:
        """Server-sent events of one continuation: a `token` event per token as decoded, then `done`.

        The decoding runs in a thread of its own that holds the lock until it ends, so a client that
        leaves mid-stream cannot leave the service locked; a failure is an `error` event.

        Raises:
            EmptyText: The prompt holds no token (raised here, before any event is sent).
        """
        prompt = self.prompt_ids(request)
        tokenizer = self.tokenizer  # the stream's text is its model's, even across a swap
        events: queue.Queue = queue.Queue()

        def run() -> None:
            try:
                events.put(("done", self._decode(prompt, request, events.put).model_dump()))
            except RuntimeError as exc:
                events.put(("error", {"detail": f"generation failed: {str(exc)[:300]}"}))

        threading.Thread(target=run, name="generate-stream", daemon=True).start()
        return _token_events(events, tokenizer)

    def _decode(
        self, prompt: list[int], request: GenerateRequest, emit: Callable[[int], None] | None
    ) -> GenerateResponse:
        sampling = None
        if request.do_sample:
            top_k = min(request.top_k, self.vocab)  # 0: the whole vocabulary
            sampling = {
                "temperature": request.temperature,
                "top_k": top_k,
                "top_p": request.top_p,
                "seed": request.seed,
            }
        with self.lock:
            generation = self.model.start(prompt, len(prompt) + request.max_new_tokens, sampling)
            start = time.perf_counter()
            tokens, steps = [generation.step()], []
            first = time.perf_counter() - start
            if emit is not None:
                emit(tokens[-1])
            while not generation.done:
                tick = time.perf_counter()
                tokens.append(generation.step())
                steps.append(time.perf_counter() - tick)
                if emit is not None:
                    emit(tokens[-1])
            drift = self.drift.add(prompt) if self.drift else None
        self._record(len(prompt), first, steps, len(tokens), drift)
        finish = "length" if len(tokens) >= request.max_new_tokens else "eos"
        return GenerateResponse(
            text=self.decode(tokens),
            tokens=len(tokens),
            finish_reason=finish,
            ttft_ms=1000 * first,
            tpot_ms=1000 * float(np.mean(steps)) if steps else None,
        )

    def _record(
        self, prompt_tokens: int, first: float, steps: list[float], generated: int, drift: float | None
    ) -> None:
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        m.ttft.observe(first)
        for step in steps:
            m.tpot.observe(step)
        m.generated.inc(generated)
        if drift is not None:
            m.drift.labels(m.version).set(drift)

    def score(self, request: FeedbackRequest) -> float:
        """Adds a reference continuation's token losses to the rolling perplexity; returns its own."""
        prompt, continuation = self.encode(request.prompt), self.encode(request.continuation)
        if not prompt or not continuation:
            raise EmptyText("the prompt and the continuation must each hold a token")
        prompt = [*self.prefix, *prompt]
        with self.lock:
            losses = self.model.token_losses(np.asarray(prompt + continuation))[len(prompt) - 1 :]
            if self.feedback_file is not None:  # the text a re-prune is run on
                self.feedback_file.parent.mkdir(parents=True, exist_ok=True)
                with self.feedback_file.open("a", encoding="utf-8") as handle:
                    handle.write(json.dumps({"text": f"{request.prompt} {request.continuation}"}) + "\n")
            self.feedback.extend(float(x) for x in losses)
            rolling = math.exp(float(np.mean(self.feedback)))
        self.metrics.perplexity.labels(self.metrics.version).set(rolling)
        self.metrics.feedback_tokens.labels(self.metrics.version).set(len(self.feedback))
        return math.exp(float(np.mean(losses)))


def _token_events(events: queue.Queue, tokenizer: object) -> Iterator[str]:
    """Turns the decoding thread's token ids into `token` events, then passes its last event on.

    Each event's text is what its tokens add to the text so far, decoded from a window that starts
    at the previous event's tokens (the context a detokeniser needs for spaces), so a token's cost
    does not grow with the continuation; tokens that end inside a character wait for the rest and
    go out with the next event.
    """
    tokens: list[int] = []
    prefix = read = 0  # tokens[prefix:read]: the window's context, already sent
    while True:
        item = events.get()
        if not isinstance(item, int):
            yield _event(*item)
            return
        tokens.append(item)
        text = tokenizer.decode(tokens[prefix:], skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            continue
        piece = text[len(tokenizer.decode(tokens[prefix:read], skip_special_tokens=True)) :]
        yield _event("token", {"tokens": tokens[read:], "text": piece})
        # The next window starts at these tokens only when they show text: a skipped special token is
        # no context (the token after it would lose the space before it).
        prefix, read = (read if piece else prefix), len(tokens)


def _event(name: str, data: dict) -> str:
    """One server-sent event."""
    return f"event: {name}\ndata: {json.dumps(data)}\n\n"


def create_decoder_app(service: DecoderService) -> FastAPI:
    """The FastAPI app over a loaded `DecoderService`."""
    app = FastAPI(title="PruneOps decoder serving")
    m = service.metrics

    @app.middleware("http")  # every response counted, refusals (422) and errors (500) included
    async def count(request, call_next):  # noqa: ANN001, ANN202
        response = await call_next(request)
        endpoint = request.url.path.strip("/")
        m.requests.labels(endpoint if endpoint in ENDPOINTS else "other", str(response.status_code)).inc()
        return response

    @app.post("/generate", response_model=GenerateResponse)
    def generate(request: GenerateRequest) -> GenerateResponse | StreamingResponse:
        try:
            if request.stream:
                return StreamingResponse(service.stream(request), media_type="text/event-stream")
            return service.generate(request)
        except EmptyText as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        except RuntimeError as exc:  # the runtime's error is a 500 with its line
            raise HTTPException(status_code=500, detail=f"generation failed: {str(exc)[:300]}") from exc

    @app.post("/feedback")
    def feedback(request: FeedbackRequest) -> dict:
        try:
            perplexity = service.score(request)
        except EmptyText as exc:
            raise HTTPException(status_code=422, detail=str(exc)) from exc
        return {"perplexity": perplexity, "rolling_tokens": len(service.feedback)}

    @app.get("/healthz")
    def healthz() -> dict:
        return {"status": "ok", "model": str(service.folder), "version": service.metrics.version}

    @app.get("/metrics")
    def metrics() -> Response:
        return Response(generate_latest(m.registry), media_type=CONTENT_TYPE_LATEST)

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
