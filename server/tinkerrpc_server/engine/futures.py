"""Request futures: every engine operation answers a request id at once; clients long-poll for the result."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Generic, Literal, TypeAlias, TypeVar

ErrorCategory = Literal["user", "server"]


@dataclass
class FailedResult:
    message: str
    category: ErrorCategory

    @property
    def size(self) -> int:
        return len(self.message)


AnswerT = TypeVar("AnswerT")
# What a request's future holds once it has run: its answer (what it is, the engine's choice), or why it
# failed.
Outcome: TypeAlias = AnswerT | FailedResult


class RequestFuture(concurrent.futures.Future[Outcome[AnswerT]], Generic[AnswerT]):
    """A request's outcome, and whether its caller still waits for it.

    The SDK long-polls retrieve_future until the outcome is there; when the SDK call is cancelled (the
    gRPC caller cancelled or passed its deadline) its poll's connection closes. A poll that ended by a
    disconnect before the outcome, with no poll after it, means nobody will read the outcome: the worker
    drops the request instead of running it. Poll counts change on the event loop only.
    """

    def __init__(self) -> None:
        super().__init__()
        self._polls = 0
        self._caller_left = False

    def poll_started(self) -> None:
        self._polls += 1
        self._caller_left = False

    def poll_ended(self, disconnected: bool) -> None:
        self._polls -= 1
        if disconnected and self._polls == 0 and not self.done():
            self._caller_left = True

    def abandon(self) -> None:
        """Its caller left without polling (a token stream's client disconnected): nobody reads it."""
        if not self.done():
            self._caller_left = True

    @property
    def abandoned(self) -> bool:
        return self._caller_left


class FutureTable(Generic[AnswerT]):
    """request id → outcome. Pending requests are kept until they finish; finished outcomes are kept, so
    a client that lost a poll response can ask again, for the requests that finished last: at most
    `keep_finished` of them and `keep_finished_bytes` of the memory they hold (`answer_size` of an
    answer; sample outcomes with top-k prompt logprobs run to megabytes), but always the last
    `always_kept`."""

    def __init__(
        self,
        answer_size: Callable[[AnswerT], int],
        keep_finished: int = 4096,
        keep_finished_bytes: int = 256 * 2**20,
        always_kept: int = 64,
    ) -> None:
        self._answer_size = answer_size
        self._lock = threading.Lock()
        self._futures: dict[str, RequestFuture[AnswerT]] = {}
        # (request id, payload bytes) in the order they finished: creating a request forgets the oldest
        # beyond the bounds in O(1), not by scanning the thousands of futures it may keep.
        self._finished: deque[tuple[str, int]] = deque()
        self._finished_bytes = 0
        self._keep_finished = keep_finished
        self._keep_finished_bytes = keep_finished_bytes
        self._always_kept = always_kept
        self._counter = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    def create(self) -> tuple[str, RequestFuture[AnswerT]]:
        request_id = f"req-{self._prefix}-{next(self._counter)}"
        future: RequestFuture[AnswerT] = RequestFuture()
        with self._lock:
            self._futures[request_id] = future
            while len(self._finished) > self._always_kept and (
                len(self._finished) > self._keep_finished or self._finished_bytes > self._keep_finished_bytes
            ):
                forgotten, size = self._finished.popleft()
                self._finished_bytes -= size
                del self._futures[forgotten]
        future.add_done_callback(lambda done: self._record_finished(request_id, done))
        return request_id, future

    def _record_finished(self, request_id: str, future: concurrent.futures.Future[Outcome[AnswerT]]) -> None:
        outcome = future.result()
        size = outcome.size if isinstance(outcome, FailedResult) else self._answer_size(outcome)
        with self._lock:
            self._finished.append((request_id, size))
            self._finished_bytes += size

    def __len__(self) -> int:
        """Requests kept: pending ones and the finished ones within the bounds (until the next create,
        one more)."""
        with self._lock:
            return len(self._futures)

    def failed(self, message: str, category: ErrorCategory = "user") -> str:
        """A request id whose outcome is already an error (for requests rejected before queueing)."""
        request_id, future = self.create()
        future.set_result(FailedResult(message, category))
        return request_id

    def get(self, request_id: str) -> RequestFuture[AnswerT] | None:
        with self._lock:
            return self._futures.get(request_id)

    async def wait(
        self, request_id: str, timeout: float, disconnected: Callable[[], Coroutine[Any, Any, None]]
    ) -> Outcome[AnswerT] | None:
        """The outcome, waiting up to `timeout` seconds or until `disconnected()` returns (the poll's
        client left); None while still pending.

        Raises KeyError for an unknown request id. The wait itself never cancels the underlying work; a
        disconnect marks it abandoned (see RequestFuture).
        """
        future = self.get(request_id)
        if future is None:
            raise KeyError(request_id)
        if not future.done():
            watcher = asyncio.ensure_future(disconnected())
            future.poll_started()
            try:
                outcome: asyncio.Future[Any] = asyncio.wrap_future(future)
                await asyncio.wait(
                    {outcome, watcher},
                    timeout=timeout,
                    return_when=asyncio.FIRST_COMPLETED,
                )
            finally:
                future.poll_ended(disconnected=watcher.done() and not watcher.cancelled())
                watcher.cancel()
        return future.result() if future.done() else None
