"""Request bodies capped in bytes before anything parses them (serving app and receiver)."""

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
        received = 0

        async def limited() -> Message:
            nonlocal received
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.limit:
                    raise HTTPException(413, f"request body over {self.limit} bytes")
            return message

        await self.app(scope, limited, send)


async def _refuse(send: Send, limit: int) -> None:
    body = b'{"error": "request body over %d bytes"}' % limit
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode())]
    await send({"type": "http.response.start", "status": 413, "headers": headers})
    await send({"type": "http.response.body", "body": body})
