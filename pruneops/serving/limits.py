"""Requests bounded before anything parses them (serving app and receiver): body bytes and read time."""

from __future__ import annotations

from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

from fastapi import HTTPException

Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


class BodyLimit:
    """ASGI middleware: 413 for a declared `content-length` over `limit`, or once a streamed body passes it.

    The declared length is checked before the app runs; a body without one (chunked) is counted
    as it is received, and the app's read of it fails with `HTTPException(413)` at the byte that
    crosses the limit, so a 50 MB body is never held in memory or parsed.
    """

    def __init__(self, app: Callable, limit: int):
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Message, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        declared = dict(scope.get("headers") or []).get(b"content-length")
        if declared is not None and (not declared.isdigit() or int(declared) > self.limit):
            await _refuse(send, self.limit)
            return
        received, complete = 0, False

        async def limited() -> Message:
            nonlocal received, complete
            message = await receive()
            if message["type"] == "http.disconnect" and not complete:  # a body cut off (or too slow)
                raise HTTPException(408, "the request body did not arrive")
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes")
                complete = not message.get("more_body", False)
            return message  # after the body, a disconnect is the client leaving: the app sees it as such

        await self.app(scope, limited, send)


async def _refuse(send: Send, limit: int) -> None:
    body = b'{"error": "request body over %d bytes"}' % limit
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})


def read_timeout_protocol(read_timeout_s: float) -> type:
    """Uvicorn's h11 protocol with a deadline on reading each request (its headers and body).

    uvicorn closes a connection that stays idle after a response (`timeout_keep_alive`), but not
    one that never sends a request, sends half its headers, or declares a body it never sends:
    each such client would hold a connection forever. With this protocol the connection is
    closed when a request is not read completely within `read_timeout_s` of its first byte (or
    of the connection, for the first request); an app waiting on that body sees a disconnect.
    """
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class ReadTimeoutH11Protocol(H11Protocol):
        def connection_made(self, transport) -> None:  # noqa: ANN001 - asyncio's signature
            super().connection_made(transport)
            self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def data_received(self, data: bytes) -> None:
            super().data_received(data)
            reading = self.conn.their_state in (h11.IDLE, h11.SEND_BODY)
            if not reading:
                self._cancel_read_deadline()
            elif self._read_deadline is None:
                self._read_deadline = self.loop.call_later(read_timeout_s, self._read_timed_out)

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_read_deadline()
            super().connection_lost(exc)

        def _cancel_read_deadline(self) -> None:
            if self._read_deadline is not None:
                self._read_deadline.cancel()
                self._read_deadline = None

        def _read_timed_out(self) -> None:
            self._read_deadline = None
            if self.conn.their_state in (h11.IDLE, h11.SEND_BODY) and not self.transport.is_closing():
                self.logger.warning("closed a connection whose request did not arrive within %.0f s", read_timeout_s)
                self.transport.close()

    return ReadTimeoutH11Protocol


def run_server(app: Callable, host: str, port: int, read_timeout_s: float, log_level: str = "info") -> None:
    """Serves `app` with uvicorn, every request read within `read_timeout_s`."""
    import uvicorn

    uvicorn.run(app, host=host, port=port, log_level=log_level, http=read_timeout_protocol(read_timeout_s))
