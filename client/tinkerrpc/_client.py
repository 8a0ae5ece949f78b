"""The blocking client and its model handle: how a call is sent; the methods are those of _methods.py."""

from __future__ import annotations

from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

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
from tinkerrpc._methods import ModelHandle, Step, SyncTransport
from tinkerrpc._retry import RetryPolicy, call_with_retry
from tinkerrpc._watch import EventStream
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)
T = TypeVar("T")


class Client(SyncTransport["Model"]):
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
        credentials, options = self._configure(
            target, token, tls, tls_server_name, timeout, retry, max_message_bytes
        )
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
        self._health = health_pb2_grpc.HealthStub(self.channel)
        if check_health:
            try:
                self.wait_until_serving(connect_timeout)
            except BaseException:
                self.channel.close()
                raise

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

    def _handle(self, name: str) -> Model:
        return Model(self, name)

    def _send(self, step: Step[T]) -> T:
        if isinstance(step, Blocking):
            return step.function()
        if isinstance(step, StreamCall):
            return self._receive(step)
        if step.service == "health":
            return step.read(self._health.Check(step.request, **self._health_options(step)))
        method = getattr(self.stub, step.rpc)
        return step.read(
            self.call(method, step.request, timeout=step.timeout, safe_to_repeat=step.safe_to_repeat)
        )

    def _receive(self, call: StreamCall[T]) -> T:
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

    def _watch(self, call: WatchCall[T]) -> EventStream[T]:
        method = getattr(self.stub, call.rpc)
        return EventStream(call, lambda c: method(c.request, timeout=c.timeout, metadata=self._metadata))


class Model(ModelHandle[Client], client_type=Client):
    """A handle on one model of a Client. Cheap to create; every method is one RPC."""
