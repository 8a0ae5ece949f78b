"""The blocking client and its model handle."""

from __future__ import annotations

import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar

import grpc
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerrpc._calls import Call, StreamCall, WatchCall
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
from tinkerrpc._methods import ModelHandle, SyncTransport
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

    def _handle(self, name: str) -> Model:
        return Model(self, name)

    def _send(self, call: Call[T] | StreamCall[T]) -> T:
        if isinstance(call, StreamCall):
            return self._receive(call)
        response = self.call(
            getattr(self.stub, call.rpc),
            call.request,
            timeout=call.timeout,
            safe_to_repeat=call.safe_to_repeat,
        )
        return call.read(response)

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
