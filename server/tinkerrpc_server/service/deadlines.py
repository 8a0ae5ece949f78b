"""Every RPC has a deadline: the caller's gRPC deadline, or --backend-timeout seconds from its start when
it set none. Each backend (tinker) future a call awaits is bounded by it, so no call waits forever on a
backend that stopped answering: it fails DEADLINE_EXCEEDED naming the operation, a Train step that was
cut short leaves its model marked for rollback (as a cancelled one does), and the model's lock is free
again. Abandoning a tinker future cancels its polling in the SDK (its `result_async` cancels the
underlying concurrent future), so nothing keeps retrying in the background."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from contextvars import ContextVar
from typing import TypeVar

from tinkerrpc_server.service import errors

Result = TypeVar("Result")

# monotonic time by which the current call must answer; each gRPC call runs in its own task and context.
_call_deadline: ContextVar[float | None] = ContextVar("call_deadline", default=None)


def start_call(time_remaining: float | None, backend_timeout: float) -> float:
    """Sets the current call's deadline (rpc decorator); returns the seconds it has."""
    seconds = backend_timeout if time_remaining is None else time_remaining
    _call_deadline.set(time.monotonic() + seconds)
    return seconds


async def bounded(future: Awaitable[Result], operation: str) -> Result:
    """`future`'s result, or DEADLINE_EXCEEDED once the current call's deadline passes (unbounded outside a
    call, e.g. start-up recovery)."""
    deadline = _call_deadline.get()
    if deadline is None:
        return await future
    try:
        return await asyncio.wait_for(_awaited(future), max(0.0, deadline - time.monotonic()))
    except TimeoutError:
        raise errors.deadline_exceeded(
            f"the backend did not finish {operation} before the call's deadline (its gRPC deadline, or "
            "--backend-timeout when it set none); nothing was committed"
        ) from None


async def _awaited(future: Awaitable[Result]) -> Result:
    return await future
