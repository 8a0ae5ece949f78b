"""Request futures: every engine operation answers a request id at once; clients long-poll for the result."""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import threading
import uuid
from collections import OrderedDict
from dataclasses import dataclass
from typing import Literal

import pydantic

ErrorCategory = Literal["user", "server"]


@dataclass
class JsonResult:
    payload: pydantic.BaseModel  # one of the SDK's response types, sent as JSON


@dataclass
class ProtoResult:
    payload: bytes


@dataclass
class FailedResult:
    message: str
    category: ErrorCategory


Outcome = JsonResult | ProtoResult | FailedResult


class FutureTable:
    """request id → outcome. Finished outcomes are kept for the most recent `keep_finished` requests
    so a client that lost a poll response can ask again."""

    def __init__(self, keep_finished: int = 4096) -> None:
        self._lock = threading.Lock()
        self._futures: OrderedDict[str, concurrent.futures.Future[Outcome]] = OrderedDict()
        self._keep_finished = keep_finished
        self._counter = itertools.count(1)
        self._prefix = uuid.uuid4().hex[:8]

    def create(self) -> tuple[str, concurrent.futures.Future[Outcome]]:
        request_id = f"req-{self._prefix}-{next(self._counter)}"
        future: concurrent.futures.Future[Outcome] = concurrent.futures.Future()
        with self._lock:
            self._futures[request_id] = future
            finished = [k for k, f in self._futures.items() if f.done()]
            for key in finished[: max(0, len(finished) - self._keep_finished)]:
                del self._futures[key]
        return request_id, future

    def failed(self, message: str, category: ErrorCategory = "user") -> str:
        """A request id whose outcome is already an error (for requests rejected before queueing)."""
        request_id, future = self.create()
        future.set_result(FailedResult(message, category))
        return request_id

    def get(self, request_id: str) -> concurrent.futures.Future[Outcome] | None:
        with self._lock:
            return self._futures.get(request_id)

    async def wait(self, request_id: str, timeout: float) -> Outcome | None:
        """The outcome, waiting up to `timeout` seconds; None while still pending.

        Raises KeyError for an unknown request id. The wait never cancels the underlying work.
        """
        future = self.get(request_id)
        if future is None:
            raise KeyError(request_id)
        if not future.done():
            await asyncio.wait({asyncio.wrap_future(future)}, timeout=timeout)
        return future.result() if future.done() else None
