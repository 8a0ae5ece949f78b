"""What a prepared call is: one RPC validated and built but not yet sent (a unary `Call`, a `StreamCall`,
a `WatchCall`), or a `Blocking` step of a plan. _calls.py makes them; the transports send them."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, Literal, Protocol, TypeVar

from google.protobuf.message import Message as ProtoMessage

T = TypeVar("T")
T_co = TypeVar("T_co", covariant=True)


@dataclass(frozen=True)
class Call(Generic[T]):
    """One RPC, validated and built, not yet sent."""

    rpc: str  # the TrainerService method's name, looked up on the sync or the async stub
    request: ProtoMessage
    read: Callable[[Any], T]  # the response message -> what the SDK method returns
    # May a retry resend it after a deadline (see RetryPolicy)? Train is, thanks to its idempotency key.
    safe_to_repeat: bool
    timeout: float | None  # None: the client's default deadline
    # "health": a gRPC health check, sent once with this wait_for_ready: the caller's plan decides what
    # a failure means, so it is neither retried nor held until the client is connected.
    service: Literal["trainer", "health"] = "trainer"
    wait_for_ready: bool | None = None


@dataclass(frozen=True)
class Blocking(Generic[T]):
    """A step of a plan that blocks without the network stack (a socket probe): the async client runs
    it in a thread."""

    function: Callable[[], T]


class StreamReader(Protocol[T_co]):
    """Takes one attempt's streamed responses, in order; `finish` builds the result, `discard` cleans up."""

    def add(self, response: Any) -> None: ...
    def finish(self) -> T_co: ...
    def discard(self) -> None: ...


@dataclass(frozen=True)
class StreamCall(Generic[T]):
    """A server-streaming RPC, validated and built, not yet sent. Only read-only streams exist, so a
    retry resends it from the start, into a fresh reader."""

    rpc: str
    request: ProtoMessage
    reader: Callable[[], StreamReader[T]]
    timeout: float | None  # for the whole stream; None: the client's default deadline


@dataclass(frozen=True)
class WatchCall(Generic[T]):
    """A server stream of events that lasts until closed, each response read into one event as it
    arrives; never retried (see _watch.py)."""

    rpc: str
    request: ProtoMessage
    read: Callable[[Any], T]
    timeout: float | None  # None: no deadline (NOT the client's default: a watch has no end of its own)
