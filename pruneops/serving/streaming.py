"""Text as it is generated: tokens to text pieces, stop strings, and a scheduled job seen from an async endpoint."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

from pruneops.serving.scheduler import Finished, Job

DISCONNECT_POLL_S = 0.1  # a client that left is noticed within this long while no token arrives


class Detokenizer:
    """Token ids to the text each adds, decoded incrementally.

    Each piece is what its tokens add to the text so far, decoded from a window that starts at
    the previous piece's tokens (the context a detokeniser needs for spaces), so a token's cost
    does not grow with the continuation; tokens that end inside a character wait for the rest and
    go out with the next piece.
    """

    def __init__(self, tokenizer: object):
        self.tokenizer = tokenizer
        self.tokens: list[int] = []
        self.prefix = self.read = 0  # tokens[prefix:read]: the window's context, already sent

    def add(self, token: int) -> tuple[list[int], str] | None:
        """The tokens not yet sent and the text they add, or None while a character is incomplete."""
        self.tokens.append(token)
        decode = self.tokenizer.decode
        text = decode(self.tokens[self.prefix :], skip_special_tokens=True)
        if text.endswith("\ufffd"):  # a character split across tokens: wait for the rest
            return None
        piece = text[len(decode(self.tokens[self.prefix : self.read], skip_special_tokens=True)) :]
        sent = self.tokens[self.read :]
        # The next window starts at these tokens only when they show text: a skipped special token is
        # no context (the token after it would lose the space before it).
        self.prefix, self.read = (self.read if piece else self.prefix), len(self.tokens)
        return sent, piece


class StopScan:
    """Text released as it arrives, except what could still become one of the stop strings.

    Once a stop string appears, the text before it is released and nothing after (`hit`).
    """

    def __init__(self, stops: Sequence[str]):
        self.stops = [s for s in stops if s]
        self.hold = max((len(s) for s in self.stops), default=1) - 1
        self.text, self.sent, self.hit = "", 0, False

    def add(self, piece: str) -> str:
        """The text that may go out now."""
        if self.hit:
            return ""
        start = max(0, self.sent - self.hold)
        self.text += piece
        found = [i for i in (self.text.find(s, start) for s in self.stops) if i >= 0]
        if found:
            self.hit = True
            return self._release(min(found))
        return self._release(len(self.text) - self.hold if self.stops else len(self.text))

    def flush(self) -> str:
        """The text held back, at the end of the generation."""
        return "" if self.hit else self._release(len(self.text))

    def _release(self, end: int) -> str:
        if end <= self.sent:
            return ""
        out, self.sent = self.text[self.sent : end], end
        return out


@dataclass
class Ended:
    """How a job ended, as an endpoint reports it."""

    finished: Finished
    stopped: bool  # a stop string ended it
    text: str  # all the text released


class JobOutput:
    """A scheduled job's output on the event loop: its tokens come through a queue the worker fills.

    Make it on the event loop (`attach` then wires the job's callbacks to it).
    """

    def __init__(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()

    def put(self, item: int | Finished) -> None:
        """Called from the worker thread."""
        self.loop.call_soon_threadsafe(self.queue.put_nowait, item)


async def pieces(
    job: Job, output: JobOutput, tokenizer: object, stops: Sequence[str], disconnected
) -> AsyncIterator[tuple[list[int], str] | Ended]:
    """(tokens, text) pieces of a job as they are decoded, then its `Ended`.

    The job is cancelled (it ends before its next token) when `disconnected()` says the client
    left, when a stop string appears, or when the consumer stops iterating (a stream closed).
    """
    detok, scan, released = Detokenizer(tokenizer), StopScan(stops), []
    try:
        while True:
            try:
                item = await asyncio.wait_for(output.queue.get(), DISCONNECT_POLL_S)
            except TimeoutError:
                if await disconnected():
                    job.cancel()
                    return
                continue
            if isinstance(item, Finished):
                tail = scan.flush()
                if tail:
                    released.append(tail)
                    yield [], tail
                yield Ended(item, scan.hit, "".join(released))
                return
            piece = detok.add(item)
            if piece is None or scan.hit:
                continue
            text = scan.add(piece[1])
            if scan.hit:
                job.cancel()
            if text or not scan.stops:
                released.append(text)
                yield piece[0], text
            if await disconnected():
                job.cancel()
                return
    finally:
        job.cancel()  # a no-op once it ended; otherwise the client is gone
