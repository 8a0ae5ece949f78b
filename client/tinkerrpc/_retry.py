"""Retries of transient failures: exponential backoff with full jitter, bounded in attempts and time."""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import grpc

from tinkerrpc._errors import raise_for_rpc_error

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    """How transient failures are retried.

    UNAVAILABLE is retried on every call (the request never reached a healthy server, or the
    server answered that it is restarting). DEADLINE_EXCEEDED is retried only on calls that are
    safe to repeat: reads, Sample, and Train (which carries an idempotency key).
    """

    max_attempts: int = 5
    initial_backoff: float = 0.1
    max_backoff: float = 5.0
    multiplier: float = 2.0
    # No new attempt starts once this many seconds have passed since the first one.
    total_timeout: float = 60.0

    def __post_init__(self) -> None:
        if self.max_attempts < 1:
            raise ValueError(f"max_attempts must be >= 1, got {self.max_attempts}")
        if self.initial_backoff < 0 or self.max_backoff < 0 or self.multiplier < 1 or self.total_timeout < 0:
            raise ValueError(f"invalid retry policy {self}")

    def backoff(self, retry_number: int, rng: random.Random | None = None) -> float:
        """Seconds to wait before retry number `retry_number` (0-based): full jitter over the capped exponential."""
        cap = min(self.max_backoff, self.initial_backoff * self.multiplier**retry_number)
        return (rng or random).uniform(0.0, cap)

    def should_retry(self, code: grpc.StatusCode, safe_to_repeat: bool) -> bool:
        if code == grpc.StatusCode.UNAVAILABLE:
            return True
        return safe_to_repeat and code == grpc.StatusCode.DEADLINE_EXCEEDED


NO_RETRY = RetryPolicy(max_attempts=1)


def _next_delay(
    policy: RetryPolicy, error: grpc.RpcError, safe_to_repeat: bool, attempt: int, started: float
) -> float | None:
    """Seconds to wait before the next attempt, or None when the error must surface."""
    code: grpc.StatusCode = error.code()
    if attempt + 1 >= policy.max_attempts or not policy.should_retry(code, safe_to_repeat):
        return None
    delay = policy.backoff(attempt)
    if time.monotonic() + delay - started > policy.total_timeout:
        return None
    return delay


def call_with_retry(policy: RetryPolicy, safe_to_repeat: bool, attempt_call: Callable[[], T]) -> T:
    """Run a blocking gRPC call with retries; failures surface as typed RPCErrors."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return attempt_call()
        except grpc.RpcError as error:
            delay = _next_delay(policy, error, safe_to_repeat, attempt, started)
            if delay is None:
                raise_for_rpc_error(error)
        time.sleep(delay)
        attempt += 1


async def call_with_retry_async(
    policy: RetryPolicy, safe_to_repeat: bool, attempt_call: Callable[[], Awaitable[T]]
) -> T:
    """Async twin of call_with_retry: the same policy and decisions, awaiting instead of blocking."""
    started = time.monotonic()
    attempt = 0
    while True:
        try:
            return await attempt_call()
        except grpc.RpcError as error:
            delay = _next_delay(policy, error, safe_to_repeat, attempt, started)
            if delay is None:
                raise_for_rpc_error(error)
        await asyncio.sleep(delay)
        attempt += 1
