"""The blocking client and its model handle."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any, Concatenate, ParamSpec, TypeVar

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
from tinkerrpc._retry import RetryPolicy, call_with_retry
from tinkerrpc._server_info import ServerInfo
from tinkerrpc._types import ModelInfo
from tinkerrpc._watch import EventStream
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc

if TYPE_CHECKING:
    import openai

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)
T = TypeVar("T")
P = ParamSpec("P")


class Client:
    """A blocking connection to a tinkerrpc server.

    `Client("127.0.0.1:50051")` connects and waits (up to `connect_timeout` seconds) until the
    server's gRPC health check reports SERVING. `token` is sent as `authorization: Bearer ...`
    on every call; `tls` is False (plaintext), True (system roots) or grpc.ChannelCredentials, and
    `tls_server_name` the name the server's certificate is checked for, when not the target's host.
    `interceptors` (grpc.UnaryUnaryClientInterceptor) see every call, retries included: tracing,
    extra metadata, fault injection in tests.
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
        interceptors: Sequence[grpc.UnaryUnaryClientInterceptor[Any, Any]] = (),
    ) -> None:
        check_target(target)
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata = auth_metadata(token)
        credentials = channel_credentials(tls)
        self._tls = credentials is not None
        options = channel_options(max_message_bytes, tls_server_name)
        channel = (
            grpc.secure_channel(target, credentials, options)
            if credentials is not None
            else grpc.insecure_channel(target, options)
        )
        # Closing the intercepted channel closes the one underneath.
        self.channel: grpc.Channel = (
            grpc.intercept_channel(channel, *interceptors) if interceptors else channel
        )
        self.stub = service_grpc.TrainerServiceStub(self.channel)
        if check_health:
            try:
                self.wait_until_serving(connect_timeout)
            except BaseException:
                self.channel.close()
                raise

    def wait_until_serving(self, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Wait for the connection and check gRPC health; UnavailableError unless SERVING within `timeout`."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        last_error: grpc.RpcError | None = None
        for service in HEALTH_SERVICE_NAMES:
            try:
                response = self._check_health(health, service, deadline)
            except grpc.RpcError as error:
                last_error = error
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise unreachable(self.target, timeout, error) from error
            check_serving(self.target, service, response)
            return
        assert last_error is not None
        raise unreachable(self.target, timeout, last_error) from last_error

    def _check_health(
        self, health: health_pb2_grpc.HealthStub, service: str, deadline: float
    ) -> health_pb2.HealthCheckResponse:
        """One health check. It first fails fast when the connection does, so that a refused port or an
        HTTP server is named at once; only a server the probe cannot explain is waited for."""
        request = health_pb2.HealthCheckRequest(service=service)
        try:
            return health.Check(
                request, timeout=remaining(deadline), metadata=self._metadata, wait_for_ready=False
            )
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            problem = first_contact_problem(self.target, self._tls)
            if problem is not None:
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, problem) from error
        return health.Check(
            request, timeout=remaining(deadline), metadata=self._metadata, wait_for_ready=True
        )

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> Client:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    def call(
        self,
        method: grpc.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
        safe_to_repeat: bool,
    ) -> Resp:
        """One RPC with auth metadata, the deadline (per call, else the client default) and retries."""
        deadline = timeout if timeout is not None else self.timeout
        return call_with_retry(
            self.retry,
            safe_to_repeat,
            lambda: method(request, timeout=deadline, metadata=self._metadata),
        )

    def _receive(self, call: calls.StreamCall[T]) -> T:
        method = getattr(self.stub, call.rpc)
        deadline = call.timeout if call.timeout is not None else self.timeout

        def attempt() -> T:
            reader = call.reader()
            try:
                for response in method(call.request, timeout=deadline, metadata=self._metadata):
                    reader.add(response)
                return reader.finish()
            except BaseException:
                reader.discard()
                raise

        return call_with_retry(self.retry, True, attempt)

    def _watch(self, call: calls.WatchCall[T]) -> EventStream[T]:
        method = getattr(self.stub, call.rpc)
        return EventStream(call, lambda c: method(c.request, timeout=c.timeout, metadata=self._metadata))

    def _send(self, call: calls.Call[T]) -> T:
        response = self.call(
            getattr(self.stub, call.rpc),
            call.request,
            timeout=call.timeout,
            safe_to_repeat=call.safe_to_repeat,
        )
        return call.read(response)

    def create_model(
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
    ) -> Model:
        """Create a model (a fresh LoRA run at policy version 0) and return its handle; with
        `exist_ok=True`, the existing model of that name when its base model, LoRA shape and renderer
        match (AlreadyExistsError naming the differences otherwise)."""
        self._send(
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
        return Model(self, name)

    def model(self, name: str) -> Model:
        """A handle on an existing model; no network call."""
        if not name:
            raise ValueError("model name must not be empty")
        return Model(self, name)

    def get_model(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        return self._send(calls.get_model(name, timeout=timeout))

    def server_info(self, *, timeout: float | None = None) -> ServerInfo:
        """The server's version, backend, hosted OpenAI sidecar URL and request limits."""
        return self._send(calls.server_info(self.target, timeout=timeout))

    def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        return self._send(calls.list_models(timeout=timeout))

    def delete_model(self, name: str, *, timeout: float | None = None) -> None:
        self._send(calls.delete_model(name, timeout=timeout))


def _sends(prepare: Callable[Concatenate[str, P], calls.Call[T]]) -> Callable[Concatenate[Model, P], T]:
    """The Model method that sends what `prepare` builds for the handle's model."""

    def method(self: Model, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.client._send(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "Model")
    return method


def _receives(
    prepare: Callable[Concatenate[str, P], calls.StreamCall[T]],
) -> Callable[Concatenate[Model, P], T]:
    """The Model method that receives the stream `prepare` builds for the handle's model."""

    def method(self: Model, /, *args: P.args, **kwargs: P.kwargs) -> T:
        return self.client._receive(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "Model")
    return method


def _watches(
    prepare: Callable[Concatenate[str, P], calls.WatchCall[T]],
) -> Callable[Concatenate[Model, P], EventStream[T]]:
    """The Model method that opens the event stream `prepare` builds for the handle's model."""

    def method(self: Model, /, *args: P.args, **kwargs: P.kwargs) -> EventStream[T]:
        return self.client._watch(prepare(self.name, *args, **kwargs))

    calls.handle_method(method, prepare, "Model")
    return method


class Model(calls.ModelHandle[Client]):
    """A handle on one model of a Client. Cheap to create; every method is one RPC."""

    def info(self, *, timeout: float | None = None) -> ModelInfo:
        return self.client.get_model(self.name, timeout=timeout)

    def openai_client(
        self, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> openai.OpenAI:
        """An `openai.OpenAI` client on the server's hosted sidecar (the URL from GetServerInfo, or
        `sidecar_url=` for a standalone one), with `api_key=` or $TINKERRPC_SIDECAR_API_KEY. Requests
        pass `model=model.name`: the openai client has no default model. `openai_options` go to
        `openai.OpenAI` (timeout, max_retries, ...). Needs `pip install 'tinkerrpc[openai]'`."""
        info = None if sidecar_url else self.client.server_info()
        base_url, key = sidecar_connection(info, sidecar_url, api_key)
        client: openai.OpenAI = import_openai().OpenAI(base_url=base_url, api_key=key, **openai_options)
        return client

    def async_openai_client(
        self, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> openai.AsyncOpenAI:
        """As `openai_client`, an `openai.AsyncOpenAI`."""
        info = None if sidecar_url else self.client.server_info()
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
