"""The decoder server's service: the loaded model, its limits, the scheduler's jobs, drift and feedback.

What the HTTP layer (`pruneops.serving.generate`, `pruneops.serving.openai_api`) calls: a prompt
checked against the context and the prompt bound (`ServeLimits`) becomes a scheduled job
(`submit`), its end is recorded in the metrics; prompts feed the drift window; `/feedback`
continuations the rolling perplexity (each distinct pair once). Torch-free.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import math
import threading
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import numpy as np
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from pydantic import AfterValidator, BaseModel, ConfigDict, Field

from pruneops.core.errors import ConfigError, PruneOpsError
from pruneops.data.corpus import affixes_of
from pruneops.data.drift import psi
from pruneops.modelstore.store import ModelRegistry, verify_version_files
from pruneops.runtimes import runtime_of
from pruneops.runtimes.chat import load_chat_template
from pruneops.serving.scheduler import Finished, Job, Scheduler

log = logging.getLogger(__name__)

TOKEN_BUCKETS = (1e-3, 2.5e-3, 5e-3, 1e-2, 2e-2, 3e-2, 5e-2, 7.5e-2, 0.1, 0.15, 0.25, 0.5, 1.0)
FIRST_TOKEN_BUCKETS = (1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
CLIENT_GONE = 499  # what a request whose client left before its answer is counted as
MIN_TOKENS_PER_BIN = 20  # prompt drift is published once the window holds this many tokens per bin


def _encodable(text: str) -> str:
    """Refuses text that is not valid Unicode (a lone surrogate cannot be tokenised)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise ValueError("the text holds a lone surrogate (not valid Unicode)") from None
    return text


Text = Annotated[str, Field(min_length=1, max_length=100_000), AfterValidator(_encodable)]


class GenerateRequest(BaseModel):
    """A prompt and how to continue it (types strict: "4" is no number, "yes" no boolean)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: Text
    max_new_tokens: Annotated[int, Field(ge=1, le=4096)] = 64
    do_sample: bool = False
    temperature: Annotated[float, Field(gt=0.0, le=10.0, allow_inf_nan=False)] = 1.0
    top_k: Annotated[int, Field(ge=0, le=100_000)] = 50
    top_p: Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)] = 1.0
    seed: Annotated[int, Field(ge=0, le=2**31 - 1)] | None = None
    stream: bool = False  # server-sent events, one per token, then `done`


class GenerateResponse(BaseModel):
    """The continuation and what it cost."""

    text: str
    tokens: int
    finish_reason: str  # eos | length | deadline
    ttft_ms: float
    tpot_ms: float | None


class FeedbackRequest(BaseModel):
    """A prompt and the continuation it should have had (a reference answer)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: Text
    continuation: Text


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
        self.finished = Counter(
            "pruneops_generations_total", "Generations by how they ended (eos, length, cancelled...)", ["reason"],
            registry=r,
        )  # fmt: skip
        self.running = Gauge("pruneops_generations_running", "Generations being decoded", registry=r)
        self.waiting = Gauge("pruneops_generations_waiting", "Generations queued", registry=r)
        self.max_prompt_tokens = Gauge("pruneops_max_prompt_tokens", "The prompt bound (ServeLimits)", registry=r)
        self.feedback_unsaved = Gauge(
            "pruneops_feedback_unsaved", "Feedback lines waiting for the feedback file to be writable", registry=r
        )
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


class BadPrompt(ValueError):
    """A request the model cannot take: no tokens, or more than its bounds allow (a 4xx, never a 5xx)."""


class EmptyText(BadPrompt):
    """A prompt or continuation that holds no token of the model's vocabulary."""


class ContextOverflow(BadPrompt):
    """A prompt longer than the server's prompt bound, or prompt and answer beyond the model's context."""


@dataclass(frozen=True)
class ServeLimits:
    """How much one request may ask of the decoder server.

    Attributes:
        max_waiting: Requests that may wait beyond those generating; more get 429 with Retry-After.
        deadline_s: A generation still running this long after it arrived ends there
            (`finish_reason` `length` in the OpenAI API, `deadline` in /generate).
        max_prompt_tokens: The most prompt tokens a request may bring (None: as many as take
            `prefill_budget_s` to read, measured on the model at load, within its context).
        prefill_budget_s: What one prompt's prefill may cost when `max_prompt_tokens` is None.
    """

    max_waiting: int = 32
    deadline_s: float = 300.0
    max_prompt_tokens: int | None = None
    prefill_budget_s: float = 10.0

    def __post_init__(self) -> None:
        given = {"max_waiting": self.max_waiting, "deadline_s": self.deadline_s,
                 "prefill_budget_s": self.prefill_budget_s, "max_prompt_tokens": self.max_prompt_tokens}  # fmt: skip
        bad = [
            f"{name} must be above 0 (got {value})" for name, value in given.items() if value is not None and value <= 0
        ]
        if bad:
            raise ConfigError(f"serve-decoder: {'; '.join(bad)}")


def prompt_bound(model: object, budget_s: float, context: int) -> int:
    """The most prompt tokens whose prefill is predicted to take `budget_s` on `model`, within its context.

    Prefill time grows faster than the prompt (attention reads every earlier token), so it is
    timed at two lengths and fitted as `a*n + b*n**2`; the bound is the largest `n` under budget.
    """
    lengths = [n for n in (32, 256) if n < context]
    if len(lengths) < 2:
        return context - 1
    times = []
    for n in lengths:
        generation = model.start([0] * n, n + 1, None)
        tick = time.perf_counter()
        generation.step()
        times.append(time.perf_counter() - tick)
    design = np.array([[n, n * n] for n in lengths], dtype=float)
    a, b = np.linalg.solve(design, np.asarray(times))
    a, b = max(a, 1e-9), max(b, 0.0)
    bound = (-a + math.sqrt(a * a + 4 * b * budget_s)) / (2 * b) if b > 0 else budget_s / a
    return int(max(lengths[0], min(context - 1, bound)))


class DecoderService:
    """The loaded model and its tokenizer, the scheduler that runs generations, and the rolling windows."""

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
        limits: ServeLimits | None = None,
    ):
        self.metrics = DecoderMetrics(Path(folder).name, psi_threshold, decode_slo_ms, prefill_slo_ms)
        self.limits = limits or ServeLimits()
        self.drift_window = drift_window
        self.feedback: deque[float] = deque(maxlen=feedback_window)
        self.feedback_seen: dict[str, None] = {}  # digests of feedback counted (a replay counts once)
        self.unsaved: deque[str] = deque(maxlen=FEEDBACK_UNSAVED)  # feedback lines the file has not taken yet
        self.feedback_file = Path(feedback_file) if feedback_file else None
        self.lock = threading.Lock()  # the model swap, the windows and the feedback file
        self.fallback_from: str | None = None  # production, where start-up served an earlier version instead
        self._load(Path(folder), reference)
        self.scheduler = Scheduler(self.model, self.limits.max_waiting)

    def _load(self, folder: Path, reference: dict | None) -> None:
        """Loads everything first, then switches: a folder that fails to load leaves the service as it was.

        A registered version's files are checked against the digests recorded at registration
        first (start-up, promotion and rollback alike): a corrupt copy is never served.
        """
        from tokenizers import Tokenizer

        try:
            if (folder / "metadata.json").is_file():  # a registered version: its files as they were registered
                verify_version_files(folder)
            chat = load_chat_template(folder)
            model = runtime_of(folder, "causal_lm").open(folder).serving()
        except PruneOpsError as exc:  # its message names the file
            raise ConfigError(f"serve-decoder: {str(exc)[:300]}") from None
        except Exception as exc:  # noqa: BLE001 - the runtime's own error types: one line naming the folder
            raise ConfigError(f"serve-decoder: {folder} does not load: {str(exc)[:300]}") from None
        try:
            tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
        except Exception as exc:  # noqa: BLE001 - tokenizers raises a bare Exception
            raise ConfigError(f"serve-decoder: {folder / 'tokenizer.json'} does not load: {str(exc)[:200]}") from None
        bound = self.limits.max_prompt_tokens or prompt_bound(model, self.limits.prefill_budget_s, model.context_length)
        self.folder, self.model, self.vocab, self.tokenizer = folder, model, model.vocab_size, tokenizer
        self.chat, self.max_prompt_tokens = chat, min(bound, model.context_length - 1)
        # The ids the tokenizer puts before a text of its own accord (a BOS): every prompt starts with them.
        self.prefix = list(affixes_of(lambda t, special: tokenizer.encode(t, add_special_tokens=special).ids).prefix)
        self.drift = PromptDrift(reference, self.drift_window) if reference else None
        self.metrics.version = folder.name
        self.metrics.max_prompt_tokens.set(self.max_prompt_tokens)
        log.info("serve-decoder: %s, context %d tokens, prompts of at most %d tokens", folder.name,
                 model.context_length, self.max_prompt_tokens)  # fmt: skip

    def swap(self, folder: Path, reference: dict | None) -> bool:
        """Serves another model folder from the next request on (a promotion); its windows start empty.

        Generations already running finish on the model they started on.

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
            self.scheduler.use(self.model)
            self.feedback.clear()
            self.feedback_seen.clear()
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

    def text_ids(self, text: str) -> list[int]:
        """A prompt's token ids after the tokenizer's own prefix (its BOS), as the corpus blocks start.

        Raises:
            EmptyText: The prompt holds no token.
        """
        prompt = self.encode(text)
        if not prompt:
            raise EmptyText("the prompt holds no tokens")
        return [*self.prefix, *prompt]

    def prompt_ids(self, request: GenerateRequest) -> list[int]:
        """`text_ids` of a /generate request's prompt."""
        return self.text_ids(request.prompt)

    def check_length(self, prompt: list[int], max_new_tokens: int) -> None:
        """Raises `ContextOverflow` for a prompt over the server's bound or an answer beyond the context."""
        context = self.model.context_length
        if len(prompt) > self.max_prompt_tokens:
            raise ContextOverflow(
                f"the prompt has {len(prompt)} tokens; this server takes at most {self.max_prompt_tokens}"
            )
        if len(prompt) + max_new_tokens > context:
            raise ContextOverflow(
                f"the prompt's {len(prompt)} tokens and {max_new_tokens} new tokens exceed the model's context of "
                f"{context} tokens"
            )

    def submit(self, prompt: list[int], max_new_tokens: int, sampling: dict | None, output) -> Job:  # noqa: ANN001
        """Queues a generation whose tokens and end go to `output.put` (a `JobOutput`, or any such sink).

        Raises:
            ContextOverflow: The prompt or the answer is beyond the bounds.
            QueueFull: The queue is full (429).
        """
        self.check_length(prompt, max_new_tokens)

        def ended(finished: Finished) -> None:
            self._record(len(prompt), finished)
            output.put(finished)

        deadline = time.monotonic() + self.limits.deadline_s
        job = Job(prompt, max_new_tokens, sampling, deadline, output.put, ended)
        self.scheduler.submit(job)
        with self.lock:
            drift = self.drift.add(prompt) if self.drift else None
        if drift is not None:
            self.metrics.drift.labels(self.metrics.version).set(drift)
        return job

    def generate(self, request: GenerateRequest) -> GenerateResponse:
        """Decodes one continuation (blocking), timing its first and every further token.

        Raises:
            RuntimeError: The runtime failed.
        """
        sink = _Collect()
        job = self.submit(self.prompt_ids(request), request.max_new_tokens, sampling_of(request, self.vocab), sink)
        finished = sink.wait()
        if finished.reason == "error":
            job.cancel()
            raise RuntimeError(finished.error)
        return generate_response(finished, self.decode(finished.tokens))

    def _record(self, prompt_tokens: int, finished: Finished) -> None:
        m = self.metrics
        m.prompt_tokens.inc(prompt_tokens)
        if finished.first_s is not None:
            m.ttft.observe(finished.first_s)
        for step in finished.steps_s:
            m.tpot.observe(step)
        m.generated.inc(len(finished.tokens))
        m.finished.labels(finished.reason).inc()

    def score(self, request: FeedbackRequest) -> dict:
        """Adds a reference continuation's token losses to the rolling perplexity once, and keeps its text.

        The same prompt and continuation sent again is scored but not counted twice. The text is
        appended to the feedback file (what a re-prune runs on); while the file cannot be written
        the lines wait in memory (`pruneops_feedback_unsaved`) and go out with the next feedback
        that can write, so a full or read-only disk loses nothing the server holds.

        Returns:
            Its perplexity, the rolling window's tokens, whether it counted and whether every
            kept line is saved.
        """
        prompt, continuation = self.encode(request.prompt), self.encode(request.continuation)
        if not prompt or not continuation:
            raise EmptyText("the prompt and the continuation must each hold a token")
        prompt = [*self.prefix, *prompt]
        self.check_length(prompt + continuation, 0)
        digest = hashlib.sha256(json.dumps([request.prompt, request.continuation]).encode()).hexdigest()
        losses = self.model.token_losses(np.asarray(prompt + continuation))[len(prompt) - 1 :]
        with self.lock:
            counted = digest not in self.feedback_seen
            if counted:
                self._count_feedback(digest, losses)
                self.unsaved.append(json.dumps({"text": f"{request.prompt} {request.continuation}"}))
            saved = self._save_feedback()
            rolling, tokens = math.exp(float(np.mean(self.feedback))), len(self.feedback)
        self.metrics.perplexity.labels(self.metrics.version).set(rolling)
        self.metrics.feedback_tokens.labels(self.metrics.version).set(tokens)
        perplexity = math.exp(float(np.mean(losses)))
        return {"perplexity": perplexity, "rolling_tokens": tokens, "counted": counted, "saved": saved}

    def _count_feedback(self, digest: str, losses: np.ndarray) -> None:
        self.feedback_seen[digest] = None
        while len(self.feedback_seen) > FEEDBACK_DIGESTS:
            del self.feedback_seen[next(iter(self.feedback_seen))]
        self.feedback.extend(float(x) for x in losses)

    def _save_feedback(self) -> bool:
        """Appends the waiting lines to the feedback file; False (they keep waiting) when it cannot be written."""
        if self.feedback_file is None:
            self.unsaved.clear()
            return True
        if self.unsaved:
            try:
                self.feedback_file.parent.mkdir(parents=True, exist_ok=True)
                with self.feedback_file.open("a", encoding="utf-8") as handle:
                    handle.write("".join(line + "\n" for line in self.unsaved))
                self.unsaved.clear()
            except OSError as exc:
                log.warning("serve-decoder: feedback file %s not written (%d lines wait): %s", self.feedback_file,
                            len(self.unsaved), exc.strerror or exc)  # fmt: skip
        self.metrics.feedback_unsaved.set(len(self.unsaved))
        return not self.unsaved


FEEDBACK_DIGESTS = 100_000  # feedback remembered for replays (oldest forgotten first)
FEEDBACK_UNSAVED = 100_000  # feedback lines held while the feedback file cannot be written


class _Collect:
    """A job's sink for a blocking caller: keeps its end, wakes the caller."""

    def __init__(self) -> None:
        self.done = threading.Event()
        self.finished: Finished | None = None

    def put(self, item: int | Finished) -> None:
        if isinstance(item, Finished):
            self.finished = item
            self.done.set()

    def wait(self) -> Finished:
        self.done.wait()
        return self.finished


def sampling_of(request: GenerateRequest, vocab: int) -> dict | None:
    """A /generate request's sampling options (None: greedy)."""
    if not request.do_sample:
        return None
    top_k = min(request.top_k, vocab)  # 0: the whole vocabulary
    return {"temperature": request.temperature, "top_k": top_k, "top_p": request.top_p, "seed": request.seed}


def generate_response(finished: Finished, text: str) -> GenerateResponse:
    """A /generate answer from a finished job."""
    return GenerateResponse(
        text=text,
        tokens=len(finished.tokens),
        finish_reason=finished.reason,
        ttft_ms=1000 * (finished.first_s or 0.0),
        tpot_ms=1000 * float(np.mean(finished.steps_s)) if finished.steps_s else None,
    )


def production_service(registry_dir: Path, **options: object) -> DecoderService:
    """The service over a registry's production decoder or, where that cannot be served, the newest earlier one.

    As the classifier server does at start-up: production that fails its digests or does not
    load (a bad copy, bit rot, a runtime that cannot read it) is logged and the production
    versions before it are tried, newest first; `fallback_from` names the one skipped.

    Raises:
        ConfigError: Nothing in production, or no production version can be served.
    """
    registry = ModelRegistry(Path(registry_dir))
    stack = registry.served_stack()
    if not stack:
        raise ConfigError(f"serve-decoder: {registry_dir} has no production model; run `pruneops publish`")
    refused = []
    for version in reversed(stack):
        try:
            path = registry.get(version).path
            stats_file = path / "reference_stats.json"
            stats = json.loads(stats_file.read_text()) if stats_file.is_file() else None
            service = DecoderService(path, stats, **options)
        except (PruneOpsError, OSError, ValueError) as exc:
            refused.append(f"{version}: {str(exc).removeprefix('serve-decoder: ')[:300]}")
            log.error("serve-decoder: cannot serve %s: %s", version, str(exc)[:300])
            continue
        if version != stack[-1]:
            service.fallback_from = stack[-1]
            log.error("serve-decoder: production %s cannot be served; serving the earlier version %s", stack[-1],
                      version)  # fmt: skip
        return service
    raise ConfigError("serve-decoder: no production version can be served: " + "; ".join(refused))
