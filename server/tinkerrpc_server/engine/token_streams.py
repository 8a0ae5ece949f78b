"""Token streams: a sample request's tokens handed from the compute thread to its HTTP stream as they are
sampled (the wire form is token_stream_wire.py's), bounded in number (MAX_ENGINE_TOKEN_STREAMS open at
once) and in what each holds unread (MAX_STREAM_BUFFERED_TOKENS: a reader that far behind loses its
stream, and its rows stop decoding).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable

from tinkerrpc.contract.limits import MAX_ENGINE_TOKEN_STREAMS, MAX_STREAM_BUFFERED_TOKENS
from tinkerrpc_server import token_stream_wire as wire
from tinkerrpc_server.engine.answers import Answer
from tinkerrpc_server.engine.compute.samples import SampleOutput, TokenEvent
from tinkerrpc_server.engine.futures import FailedResult, Outcome


class TokenStream:
    """One request's sampled tokens, pushed on the compute thread and taken on the event loop."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, max_buffered: int = MAX_STREAM_BUFFERED_TOKENS
    ) -> None:
        self._loop = loop
        self._max_buffered = max_buffered
        self._lock = threading.Lock()
        self._pending: list[TokenEvent] = []
        self._arrived = asyncio.Event()
        self.overflowed = False
        # Called once, on the compute thread, when the reader falls MAX_STREAM_BUFFERED_TOKENS behind.
        self.on_overflow: Callable[[], None] = lambda: None

    def push(self, event: TokenEvent) -> None:
        """A token sampled (compute thread): buffered, and the reader woken when it was waiting."""
        with self._lock:
            if self.overflowed:
                return
            if len(self._pending) >= self._max_buffered:
                self.overflowed = True
                self._pending.clear()
            else:
                self._pending.append(event)
            wake = self.overflowed or len(self._pending) == 1
        if self.overflowed:
            self.on_overflow()
        if wake:
            self._loop.call_soon_threadsafe(self._arrived.set)

    def take(self) -> list[TokenEvent]:
        """The tokens pushed since the last take (event loop)."""
        with self._lock:
            taken, self._pending = self._pending, []
            self._arrived.clear()
        return taken

    async def arrived(self) -> None:
        await self._arrived.wait()


class StreamSlots:
    """How many token streams are open; at most MAX_ENGINE_TOKEN_STREAMS (event loop only)."""

    def __init__(self, limit: int = MAX_ENGINE_TOKEN_STREAMS) -> None:
        self.limit = limit
        self.open = 0

    def acquire(self) -> bool:
        if self.open >= self.limit:
            return False
        self.open += 1
        return True

    def release(self) -> None:
        self.open -= 1


def tokens_line(events: list[TokenEvent]) -> bytes:
    return wire.tokens_line(
        [wire.StreamedToken(e.sample_index, e.token, e.logprob, e.top, e.stop_reason) for e in events]
    )


def outcome_line(outcome: Outcome[Answer]) -> bytes:
    if isinstance(outcome, FailedResult):
        return wire.failed_line(outcome.message, outcome.category)
    assert isinstance(outcome, SampleOutput), f"a sample request answered {type(outcome).__name__}"
    sequences = [wire.StreamedSequence(s.tokens, s.logprobs, s.stop_reason) for s in outcome.sequences]
    return wire.done_line(wire.StreamDone(sequences, outcome.prompt_logprobs))
