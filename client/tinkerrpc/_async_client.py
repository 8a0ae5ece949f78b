"""The asyncio client (grpc.aio) and its model handle: how a call is awaited; the methods (the sync API,
awaitable) are those of _methods.py."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2_grpc

from tinkerrpc._call_kinds import Blocking, StreamCall, WatchCall
from tinkerrpc._channel import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    TlsOption,
)
from tinkerrpc._methods import AsyncTransport, ModelHandle, Step
from tinkerrpc._retry import RetryPolicy, call_with_retry_async
from tinkerrpc._watch import AsyncEventStream
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)
T = TypeVar("T")


class AsyncClient(AsyncTransport["AsyncModel"]):
    """An asyncio connection to a tinkerrpc server; the options are those of `Client`, with
    `interceptors` of type grpc.aio.UnaryUnaryClientInterceptor.

    The health check runs on `await client.connect()`, on `async with`, or else before the first call.
    """

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls: TlsOption = False,
        *,
        tls_server_name: str | None = None,
        timeout: float | None = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        check_health: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.UnaryUnaryClientInterceptor[Any, Any]] = (),
    ) -> None:
        credentials, options = self._configure(
            target, token, tls, tls_server_name, timeout, retry, max_message_bytes
        )
        self.connect_timeout = connect_timeout
        # grpc-stubs leaves aio's interceptor type as a placeholder that must be cast.
        aio_interceptors = cast("list[grpc.aio.ClientInterceptor]", list(interceptors))
        self.channel: grpc.aio.Channel = (
            grpc.aio.secure_channel(target, credentials, options, interceptors=aio_interceptors)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options, interceptors=aio_interceptors)
        )
        # The stub's overloads type it as TrainerServiceAsyncStub (a stubs-only name) for an aio channel.
        self.stub = service_grpc.TrainerServiceStub(self.channel)
        self._health = health_pb2_grpc.HealthStub(self.channel)
        self._healthy = not check_health
        self._health_lock = asyncio.Lock()

    async def connect(self) -> AsyncClient:
        """Check health once (UnavailableError unless SERVING within connect_timeout); returns self."""
        async with self._health_lock:
            if not self._healthy:
                await self.wait_until_serving(self.connect_timeout)
                self._healthy = True
        return self

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        try:
            return await self.connect()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
        safe_to_repeat: bool,
    ) -> Resp:
        """One RPC with auth metadata, the deadline (per call, else the client default) and retries."""
        await self.connect()
        deadline = timeout if timeout is not None else self.timeout

        async def attempt() -> Resp:
            return await method(request, timeout=deadline, metadata=self._metadata)

        return await call_with_retry_async(self.retry, safe_to_repeat, attempt)

    def _handle(self, name: str) -> AsyncModel:
        return AsyncModel(self, name)

    async def _send(self, step: Step[T]) -> T:
        if isinstance(step, Blocking):
            return await asyncio.to_thread(step.function)
        if isinstance(step, StreamCall):
            return await self._receive(step)
        if step.service == "health":
            return step.read(await self._health.Check(step.request, **self._health_options(step)))
        method = getattr(self.stub, step.rpc)
        return step.read(
            await self.call(method, step.request, timeout=step.timeout, safe_to_repeat=step.safe_to_repeat)
        )

    async def _receive(self, call: StreamCall[T]) -> T:
        await self.connect()
        method = getattr(self.stub, call.rpc)
        deadline = call.timeout if call.timeout is not None else self.timeout

        async def attempt() -> T:
            reader = call.reader()
            try:
                async for response in method(call.request, timeout=deadline, metadata=self._metadata):
                    reader.add(response)
                return reader.finish()
            except BaseException:
                reader.discard()
                raise

        return await call_with_retry_async(self.retry, True, attempt)

    def _watch(self, call: WatchCall[T]) -> AsyncEventStream[T]:
        async def start(started: WatchCall[T]) -> Any:
            await self.connect()
            method = getattr(self.stub, started.rpc)
            return method(started.request, timeout=started.timeout, metadata=self._metadata)

        return AsyncEventStream(call, start)


class AsyncModel(ModelHandle[AsyncClient], client_type=AsyncClient):
    """A handle on one model of an AsyncClient; every method is one awaitable RPC."""
