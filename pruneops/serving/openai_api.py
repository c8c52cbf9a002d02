"""The OpenAI API on the decoder server: /v1/completions, /v1/chat/completions and /v1/models.

What the OpenAI API and the servers LLM users know (vLLM, TGI, llama.cpp's server) take and give,
so SDKs (the official `openai` client), gateways and evaluation harnesses work unchanged:
`max_tokens` (`max_completion_tokens` for chat), `temperature` (0: greedy), `top_p`, `seed`,
`stop` (up to 4 strings), `stream` with `stream_options.include_usage`, and `usage` counts. Chat
messages are rendered with the model's own chat template (`pruneops.serving.chat`). Streams are
server-sent `data:` chunks (`text_completion` / `chat.completion.chunk` objects) ending in
`data: [DONE]`. Errors are OpenAI's shape, `{"error": {"message", "type", "param", "code"}}`.
A field the API has but this server cannot honour (`n` > 1, `logprobs`, `echo`, penalties, tools)
is refused with 400 naming it, never ignored. Generations run in the same scheduler, metrics,
drift window and limits as /generate.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Annotated, Any, Literal

from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, model_validator

from pruneops.runtimes.chat import TemplateError
from pruneops.serving.decoder_service import CLIENT_GONE, BadPrompt
from pruneops.serving.scheduler import QueueFull
from pruneops.serving.streaming import Ended, JobOutput, pieces

if TYPE_CHECKING:
    from pruneops.serving.decoder_service import DecoderService

ERROR_TYPES = {400: "invalid_request_error", 404: "invalid_request_error", 413: "invalid_request_error",
               422: "invalid_request_error", 429: "rate_limit_exceeded", 503: "server_error"}  # fmt: skip
MAX_STOPS = 4


def error_body(status: int, message: str, param: str | None = None, code: str | None = None) -> dict:
    """An error in the OpenAI API's shape."""
    kind = ERROR_TYPES.get(status, "server_error" if status >= 500 else "invalid_request_error")
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


class OpenAIError(HTTPException):
    """An error answered in the OpenAI API's shape, naming the parameter at fault."""

    def __init__(self, status: int, message: str, param: str | None = None, code: str | None = None):
        super().__init__(status, message)
        self.param, self.code = param, code


Temperature = Annotated[float, Field(ge=0.0, le=2.0, allow_inf_nan=False)]
TopP = Annotated[float, Field(gt=0.0, le=1.0, allow_inf_nan=False)]
Seed = Annotated[int, Field(ge=0, le=2**31 - 1)]
MaxTokens = Annotated[int, Field(ge=1, le=4096)]
Stop = Annotated[str, Field(min_length=1, max_length=200)] | Annotated[list[str], Field(max_length=MAX_STOPS)]
Penalty = Annotated[float, Field(ge=0.0, le=0.0)]  # only 0 (none) is honoured


class StreamOptions(BaseModel):
    """`stream_options`: a last chunk with the usage counts."""

    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Sampling(BaseModel):
    """What both endpoints share (types strict; fields this server cannot honour are refused)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    model: Annotated[str, Field(min_length=1, max_length=200)]
    temperature: Temperature | None = None  # OpenAI's default, 1
    top_p: TopP | None = None
    seed: Seed | None = None
    stop: Stop | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    n: Annotated[int, Field(ge=1, le=1)] = 1
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    user: Annotated[str, Field(max_length=256)] | None = None

    def sampling(self, vocab: int) -> dict | None:
        """The runtime's sampling options (None: greedy, as temperature 0 asks)."""
        temperature = 1.0 if self.temperature is None else self.temperature
        if temperature == 0.0:
            return None
        top_p = 1.0 if self.top_p is None else self.top_p
        return {"temperature": temperature, "top_k": 0, "top_p": top_p, "seed": self.seed}

    def stops(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if any(not s or len(s) > 200 for s in stops):
            raise OpenAIError(400, "each stop string holds 1 to 200 characters", "stop")
        return stops


class CompletionRequest(_Sampling):
    """POST /v1/completions."""

    prompt: Annotated[str, Field(min_length=1, max_length=100_000)] | Annotated[list[str], Field(min_length=1)]
    max_tokens: MaxTokens | None = 16  # OpenAI's default
    logprobs: None = None
    echo: Literal[False] = False
    best_of: Annotated[int, Field(ge=1, le=1)] | None = None
    suffix: None = None

    def text(self) -> str:
        if isinstance(self.prompt, list):
            if len(self.prompt) != 1:
                raise OpenAIError(400, "this server completes one prompt per request", "prompt")
            return _checked_text(self.prompt[0], "prompt")
        return _checked_text(self.prompt, "prompt")


class TextPart(BaseModel):
    """A text part of a message's content."""

    model_config = ConfigDict(extra="forbid", strict=True)
    type: Literal["text"]
    text: str


class Message(BaseModel):
    """One chat message (text only)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "developer", "user", "assistant"]
    content: Annotated[str, Field(max_length=100_000)] | list[TextPart]
    name: Annotated[str, Field(max_length=64)] | None = None

    def text(self) -> str:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return _checked_text(text, "messages", allow_empty=True)


class ChatRequest(_Sampling):
    """POST /v1/chat/completions."""

    messages: Annotated[list[Message], Field(min_length=1, max_length=1000)]
    max_tokens: MaxTokens | None = None
    max_completion_tokens: MaxTokens | None = None
    logprobs: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_limit(self) -> ChatRequest:
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_completion_tokens or max_tokens, not both")
        return self

    def limit(self, room: int) -> int:
        """The token limit asked, or all the context leaves (at most 4096), as OpenAI's chat default."""
        asked = self.max_completion_tokens or self.max_tokens
        return asked if asked is not None else max(1, min(4096, room))


def _checked_text(text: str, param: str, allow_empty: bool = False) -> str:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        raise OpenAIError(400, "the text holds a lone surrogate (not valid Unicode)", param) from None
    if not text and not allow_empty:
        raise OpenAIError(400, "the prompt is empty", param)
    if len(text) > 100_000:
        raise OpenAIError(400, "a text holds at most 100000 characters", param)
    return text


def _usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _finish_reason(ended: Ended) -> str:
    """OpenAI's finish reason: `stop` (end of sequence or a stop string) or `length` (limit or deadline)."""
    return "stop" if ended.stopped or ended.finished.reason == "eos" else "length"


class _Call:
    """One OpenAI request being answered: its id, its prompt ids and its job's output."""

    def __init__(self, service: DecoderService, kind: str, name: str):
        self.service, self.kind, self.name = service, kind, name
        self.id = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def chunk(self, choice: dict, usage: dict | None = None) -> str:
        kind = "chat.completion.chunk" if self.kind == "chat" else "text_completion"
        body = {"id": self.id, "object": kind, "created": self.created, "model": self.name, "choices": [choice]}
        if usage is not None:
            body["choices"], body["usage"] = [], usage
        return f"data: {json.dumps(body)}\n\n"

    def piece(self, text: str, finish: str | None = None, first: bool = False) -> str:
        if self.kind == "chat":
            delta = {"role": "assistant", "content": text} if first else ({"content": text} if text else {})
            return self.chunk({"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish})
        return self.chunk({"index": 0, "text": text, "logprobs": None, "finish_reason": finish})

    def answer(self, ended: Ended, prompt_tokens: int) -> dict:
        finish, text = _finish_reason(ended), ended.text
        if self.kind == "chat":
            choice = {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                      "finish_reason": finish}  # fmt: skip
            kind = "chat.completion"
        else:
            choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
            kind = "text_completion"
        usage = _usage(prompt_tokens, len(ended.finished.tokens))
        return {"id": self.id, "object": kind, "created": self.created, "model": self.name, "choices": [choice],
                "usage": usage}  # fmt: skip


async def _chunks(call: _Call, stream: AsyncIterator, prompt_tokens: int, usage: bool) -> AsyncIterator[str]:
    """The OpenAI stream of one job: pieces, the finishing chunk, usage if asked, `[DONE]`."""
    if call.kind == "chat":
        yield call.piece("", first=True)
    async for item in stream:
        if not isinstance(item, Ended):
            if item[1]:
                yield call.piece(item[1])
            continue
        if item.finished.reason == "error":
            body = error_body(500, f"generation failed: {item.finished.error}")
            yield f"data: {json.dumps(body)}\n\n"
        else:
            yield call.piece("", _finish_reason(item))
            if usage:
                yield call.chunk({}, _usage(prompt_tokens, len(item.finished.tokens)))
    yield "data: [DONE]\n\n"


async def _run(
    call: _Call, body: _Sampling, prompt: list[int], limit: int, request: Request
) -> dict | StreamingResponse | Response:
    """Queues the generation and answers it, streamed or whole."""
    service = call.service
    output = JobOutput()
    try:
        job = service.submit(prompt, limit, body.sampling(service.vocab), output)
    except QueueFull as exc:
        raise HTTPException(429, str(exc), headers={"Retry-After": str(exc.retry_after_s)}) from None
    except BadPrompt as exc:  # the context or the prompt bound
        raise OpenAIError(400, str(exc), "prompt" if call.kind == "text" else "messages",
                          "context_length_exceeded") from None  # fmt: skip
    stream = pieces(job, output, service.tokenizer, body.stops(), request.is_disconnected)
    if body.stream:
        usage = bool(body.stream_options and body.stream_options.include_usage)
        return StreamingResponse(_chunks(call, stream, len(prompt), usage), media_type="text/event-stream")
    ended = None
    async for item in stream:
        if isinstance(item, Ended):
            ended = item
    if ended is None:
        return Response(status_code=CLIENT_GONE)
    if ended.finished.reason == "error":
        raise HTTPException(500, f"generation failed: {ended.finished.error}")
    return call.answer(ended, len(prompt))


def install_openai_routes(app: FastAPI, service: DecoderService, served_name: str) -> None:
    """/v1/models, /v1/completions and /v1/chat/completions on the decoder app."""
    from fastapi.responses import JSONResponse

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return JSONResponse(error_body(exc.status_code, exc.detail, exc.param, exc.code), status_code=exc.status_code)

    @app.get("/v1/models")
    def models() -> dict:
        card = {"id": served_name, "object": "model", "created": int(service.folder.stat().st_mtime),
                "owned_by": "pruneops", "root": service.metrics.version}  # fmt: skip
        return {"object": "list", "data": [card]}

    @app.post("/v1/completions", response_model=None)
    async def completions(body: CompletionRequest, request: Request) -> Any:
        _check_model(body.model, served_name)
        try:
            prompt = service.text_ids(body.text())
        except BadPrompt as exc:
            raise OpenAIError(400, str(exc), "prompt") from None
        return await _run(_Call(service, "text", served_name), body, prompt, body.max_tokens or 16, request)

    @app.post("/v1/chat/completions", response_model=None)
    async def chat(body: ChatRequest, request: Request) -> Any:
        _check_model(body.model, served_name)
        prompt = _chat_prompt(service, body)
        limit = body.limit(service.model.context_length - len(prompt))
        return await _run(_Call(service, "chat", served_name), body, prompt, limit, request)


def _check_model(name: str, served_name: str) -> None:
    if name != served_name:
        raise OpenAIError(404, f"the model '{name[:200]}' is not served here; this server serves "
                          f"'{served_name}' (GET /v1/models)", "model", "model_not_found")  # fmt: skip


def _chat_prompt(service: DecoderService, body: ChatRequest) -> list[int]:
    """The messages rendered by the model's chat template, as token ids (the template writes any BOS)."""
    if service.chat is None:
        raise OpenAIError(400, "this model has no chat template: use /v1/completions", "messages")
    messages = [{"role": m.role, "content": m.text(), **({"name": m.name} if m.name else {})} for m in body.messages]
    try:
        prompt = service.encode(service.chat.render(messages))
    except TemplateError as exc:
        raise OpenAIError(400, str(exc)[:300], "messages") from None
    if not prompt:
        raise OpenAIError(400, "the messages render to no tokens", "messages")
    return prompt
