"""The asyncio client (grpc.aio) and its model handle: the sync API, awaitable; requests are built by the same code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable, Coroutine, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar, cast

import grpc
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerrpc import _calls as calls
from tinkerrpc._channel import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    HEALTH_SERVICE_NAMES,
    TlsOption,
    auth_metadata,
    channel_credentials,
    channel_options,
    check_serving,
    check_target,
    first_contact_problem,
    remaining,
    unreachable,
)
from tinkerrpc._errors import UnavailableError
from tinkerrpc._openai_client import import_openai, sidecar_connection
from tinkerrpc._retry import RetryPolicy, call_with_retry_async
from tinkerrpc._server_info import ServerInfo
from tinkerrpc._types import ModelInfo
from tinkerrpc._watch import AsyncEventStream
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc

if TYPE_CHECKING:
    import openai

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)
T = TypeVar("T")
P = ParamSpec("P")


class AsyncClient:
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
        check_target(target)
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.connect_timeout = connect_timeout
        self._metadata = auth_metadata(token)
        credentials = channel_credentials(tls)
        self._tls = credentials is not None
        options = channel_options(max_message_bytes, tls_server_name)
        # grpc-stubs leaves aio's interceptor type as a placeholder that must be cast.
        aio_interceptors = cast("list[grpc.aio.ClientInterceptor]", list(interceptors))
        self.channel: grpc.aio.Channel = (
            grpc.aio.secure_channel(target, credentials, options, interceptors=aio_interceptors)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options, interceptors=aio_interceptors)
        )
        # The stub's overloads type it as TrainerServiceAsyncStub (a stubs-only name) for an aio channel.
        self.stub = service_grpc.TrainerServiceStub(self.channel)
        self._healthy = not check_health
        self._health_lock = asyncio.Lock()

    async def connect(self) -> AsyncClient:
        """Check health once (UnavailableError unless SERVING within connect_timeout); returns self."""
        async with self._health_lock:
            if not self._healthy:
                await self.wait_until_serving(self.connect_timeout)
                self._healthy = True
        return self

    async def wait_until_serving(self, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Wait for the connection and check gRPC health; UnavailableError unless SERVING within `timeout`."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        last_error: grpc.RpcError | None = None
        for service in HEALTH_SERVICE_NAMES:
            try:
                response = await self._check_health(health, service, deadline)
            except grpc.RpcError as error:
                last_error = error
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise unreachable(self.target, timeout, error) from error
            check_serving(self.target, service, response)
            return
        assert last_error is not None
        raise unreachable(self.target, timeout, last_error) from last_error

    async def _check_health(
        self, health: health_pb2_grpc.HealthStub, service: str, deadline: float
    ) -> health_pb2.HealthCheckResponse:
        """One health check, failing fast with the reason when the connection does (see Client)."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            return await health.Check(
                request, timeout=remaining(deadline), metadata=self._metadata, wait_for_ready=False
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            problem = await asyncio.to_thread(first_contact_problem, self.target, self._tls)
            if problem is not None:
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, problem) from error
        return await health.Check(
            request, timeout=remaining(deadline), metadata=self._metadata, wait_for_ready=True
        )

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

    async def _receive(self, call: calls.StreamCall[T]) -> T:
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

    def _watch(self, call: calls.WatchCall[T]) -> AsyncEventStream[T]:
        async def start(started: calls.WatchCall[T]) -> Any:
            await self.connect()
            method = getattr(self.stub, started.rpc)
            return method(started.request, timeout=started.timeout, metadata=self._metadata)

        return AsyncEventStream(call, start)

    async def _send(self, call: calls.Call[T]) -> T:
        response = await self.call(
            getattr(self.stub, call.rpc),
            call.request,
            timeout=call.timeout,
            safe_to_repeat=call.safe_to_repeat,
        )
        return call.read(response)

    async def create_model(
        self,
        name: str,
        base_model: str,
        *,
        lora_rank: int = 32,
        renderer: str | None = None,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        exist_ok: bool = False,
        timeout: float | None = None,
    ) -> AsyncModel:
        """Create a model (a fresh LoRA run at policy version 0) and return its handle; with
        `exist_ok=True`, the existing model of that name when its base model, LoRA shape and renderer
        match (AlreadyExistsError naming the differences otherwise)."""
        await self._send(
            calls.create_model(
                name,
                base_model,
                lora_rank=lora_rank,
                renderer=renderer,
                seed=seed,
                train_mlp=train_mlp,
                train_attn=train_attn,
                train_unembed=train_unembed,
                exist_ok=exist_ok,
                timeout=timeout,
            )
        )
        return AsyncModel(self, name)

    def model(self, name: str) -> AsyncModel:
        """A handle on an existing model; no network call."""
        if not name:
            raise ValueError("model name must not be empty")
        return AsyncModel(self, name)

    async def get_model(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        return await self._send(calls.get_model(name, timeout=timeout))

    async def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """The server's version, backend, hosted OpenAI sidecar URL and request limits."""
        return await self._send(calls.server_info(self.target, timeout=timeout))

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return await self._send(calls.list_models(timeout=timeout))

    async def delete_model(self, name: str, *, timeout: float | None = None) -> None:
        await self._send(calls.delete_model(name, timeout=timeout))


def _sends(
    prepare: Callable[Concatenate[str, P], calls.Call[T]],
) -> Callable[Concatenate[AsyncModel, P], Coroutine[Any, Any, T]]:
    """The AsyncModel method that sends what `prepare` builds for the handle's model."""

    async def method(self: AsyncModel, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.client._send(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "AsyncModel")
    return method


def _receives(
    prepare: Callable[Concatenate[str, P], calls.StreamCall[T]],
) -> Callable[Concatenate[AsyncModel, P], Coroutine[Any, Any, T]]:
    """The AsyncModel method that receives the stream `prepare` builds for the handle's model."""

    async def method(self: AsyncModel, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return await self.client._receive(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "AsyncModel")
    return method


def _watches(
    prepare: Callable[Concatenate[str, P], calls.WatchCall[T]],
) -> Callable[Concatenate[AsyncModel, P], AsyncEventStream[T]]:
    """The AsyncModel method that opens (on its first event) the stream `prepare` builds for the handle's
    model; not a coroutine: `async for event in model.watch(...)`."""

    def method(self: AsyncModel, /, *args: P.args, **kwargs: P.kwargs) -> AsyncEventStream[T]:
        return self.client._watch(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "AsyncModel")
    return method


class AsyncModel(calls.ModelHandle[AsyncClient]):
    """A handle on one model of an AsyncClient; every method is one awaitable RPC."""

    async def info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self.client.get_model(self.name, timeout=timeout)

    async def openai_client(
        self, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> openai.OpenAI:
        """As `Model.openai_client`: an `openai.OpenAI` on the sidecar (awaited: it asks the server
        for the sidecar's URL unless `sidecar_url=` is given). Requests pass `model=model.name`."""
        info = None if sidecar_url else await self.client.server_info()
        base_url, key = sidecar_connection(info, sidecar_url, api_key)
        client: openai.OpenAI = import_openai().OpenAI(base_url=base_url, api_key=key, **openai_options)
        return client

    async def async_openai_client(
        self, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> openai.AsyncOpenAI:
        """As `Model.async_openai_client`: an `openai.AsyncOpenAI` on the sidecar."""
        info = None if sidecar_url else await self.client.server_info()
        base_url, key = sidecar_connection(info, sidecar_url, api_key)
        client: openai.AsyncOpenAI = import_openai().AsyncOpenAI(
            base_url=base_url, api_key=key, **openai_options
        )
        return client

    sample = _sends(calls.sample)
    train = _sends(calls.train)
    train_supervised = _sends(calls.train_supervised)
    save_checkpoint = _sends(calls.save_checkpoint)
    checkpoints = _sends(calls.checkpoints)
    restore = _sends(calls.restore)
    delete_checkpoint = _sends(calls.delete_checkpoint)
    export_weights = _receives(calls.export_weights)
    history = _sends(calls.history)
    watch = _watches(calls.watch)
