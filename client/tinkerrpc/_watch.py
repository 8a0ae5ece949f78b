"""Event streams that last until closed (WatchModel): a sync iterator and an async one over the same
prepared call. They are not retried: each event says where the model is, so a caller that loses the
stream watches again from the version after the last one it saw."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator
from types import TracebackType
from typing import Any, Generic, TypeVar

import grpc

from tinkerrpc._call_kinds import WatchCall
from tinkerrpc._errors import raise_for_rpc_error

T = TypeVar("T")


class EventStream(Generic[T]):
    """Iterate to receive events as they happen; `close()` (or leaving a `with` block) ends the stream."""

    def __init__(self, call: WatchCall[T], start: Callable[[WatchCall[T]], Any]) -> None:
        self._read = call.read
        self._responses = start(call)

    def __iter__(self) -> Iterator[T]:
        return self

    def __next__(self) -> T:
        try:
            return self._read(next(self._responses))
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED:
                raise StopIteration from None  # closed by us
            raise_for_rpc_error(error)
            raise

    def close(self) -> None:
        self._responses.cancel()

    def __enter__(self) -> EventStream[T]:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


class AsyncEventStream(Generic[T]):
    """`async for` to receive events as they happen; `await close()` (or leaving an `async with` block)
    ends the stream. The call starts with the first event awaited."""

    def __init__(self, call: WatchCall[T], start: Callable[[WatchCall[T]], Any]) -> None:
        self._call = call
        self._start = start
        self._responses: Any = None
        self._received: AsyncIterator[Any] | None = None
        self._closed = False

    def __aiter__(self) -> AsyncIterator[T]:
        return self

    async def __anext__(self) -> T:
        if self._closed:
            raise StopAsyncIteration
        if self._received is None:
            self._responses = await self._start(self._call)
            self._received = self._responses.__aiter__()
        try:
            response = await anext(self._received)
        except grpc.RpcError as error:
            if error.code() == grpc.StatusCode.CANCELLED and self._closed:
                raise StopAsyncIteration from None
            raise_for_rpc_error(error)
            raise
        return self._call.read(response)

    async def close(self) -> None:
        self._closed = True
        if self._responses is not None:
            self._responses.cancel()

    async def __aenter__(self) -> AsyncEventStream[T]:
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()
