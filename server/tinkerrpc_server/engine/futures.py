"""Request futures: every engine operation answers a request id at once; clients long-poll for the result."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import json
import threading
import uuid
from collections import deque
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any, Literal

import pydantic

ErrorCategory = Literal["user", "server"]


@dataclass
class JsonResult:
    payload: pydantic.BaseModel  # one of the SDK's response types, sent as JSON

    def __post_init__(self) -> None:
        # Checked where the work runs: a value JSON cannot carry (NaN, infinity) fails the request, which
        # the SDK reports, instead of an HTTP 500 from retrieve_future, which the SDK retries without end.
        try:
            json.dumps(self.payload.model_dump(mode="json"), allow_nan=False)
        except ValueError as error:
            raise UnencodableResultError(
                f"{type(self.payload).__name__} holds a value JSON cannot carry ({error})"
            ) from None


class UnencodableResultError(ValueError):
    """An operation's result holds a non-finite number; the request fails as a server error."""


@dataclass
class ProtoResult:
    payload: bytes


@dataclass
class FailedResult:
    message: str
    category: ErrorCategory


Outcome = JsonResult | ProtoResult | FailedResult


class RequestFuture(concurrent.futures.Future[Outcome]):
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

    @property
    def abandoned(self) -> bool:
        return self._caller_left


class FutureTable:
    """request id → outcome. Finished outcomes are kept for the `keep_finished` requests that finished
    last, so a client that lost a poll response can ask again; pending ones until they finish."""

    def __init__(self, keep_finished: int = 4096) -> None:
        self._lock = threading.Lock()
        self._futures: dict[str, RequestFuture] = {}
        # In the order they finished: creating a request forgets the oldest beyond keep_finished in
        # O(1), where scanning every kept future cost ~2 ms a request once thousands were kept.
        self._finished: deque[str] = deque()
        self._keep_finished = keep_finished
        self._counter = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    def create(self) -> tuple[str, RequestFuture]:
        request_id = f"req-{self._prefix}-{next(self._counter)}"
        future = RequestFuture()
        with self._lock:
            self._futures[request_id] = future
            while len(self._finished) > self._keep_finished:
                del self._futures[self._finished.popleft()]
        future.add_done_callback(lambda _: self._record_finished(request_id))
        return request_id, future

    def _record_finished(self, request_id: str) -> None:
        with self._lock:
            self._finished.append(request_id)

    def __len__(self) -> int:
        """Requests kept: pending ones and at most keep_finished finished ones (+1 until the next create)."""
        with self._lock:
            return len(self._futures)

    def failed(self, message: str, category: ErrorCategory = "user") -> str:
        """A request id whose outcome is already an error (for requests rejected before queueing)."""
        request_id, future = self.create()
        future.set_result(FailedResult(message, category))
        return request_id

    def get(self, request_id: str) -> RequestFuture | None:
        with self._lock:
            return self._futures.get(request_id)

    async def wait(
        self, request_id: str, timeout: float, disconnected: Callable[[], Coroutine[Any, Any, None]]
    ) -> Outcome | None:
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
