"""Every public method of the clients and their model handles, written once for sync and async.

A method is a body (a function of its owner, the client or the model handle, and the method's own
arguments) that returns what to send: one prepared call from _calls.py, or a plan, a generator that
yields steps (calls, or a blocking socket probe) and is sent their results (`value = yield from
ask(call)`), for a method that needs more than one call or works on the answer. `ClientMethods` and
`ModelHandle` hold the method tables; `SyncTransport` (Client) and `AsyncTransport` (AsyncClient) only
say how one step is run, so the two APIs mirror by construction. The descriptors' overloads give each
method its sync or async type.
"""

from __future__ import annotations

import inspect
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Coroutine, Generator, Iterator
from contextlib import contextmanager
from functools import partial
from types import MethodType
from typing import TYPE_CHECKING, Any, Concatenate, Generic, ParamSpec, TypeVar, overload

import grpc
from grpc_health.v1 import health_pb2

from tinkerrpc import _calls as calls
from tinkerrpc._call_kinds import Blocking, Call, StreamCall, WatchCall
from tinkerrpc._channel import (
    DEFAULT_CONNECT_TIMEOUT,
    HEALTH_SERVICE_NAMES,
    Metadata,
    TlsOption,
    auth_metadata,
    channel_credentials,
    channel_options,
    check_serving,
    check_target,
    first_contact_problem,
    unreachable,
)
from tinkerrpc._errors import UnavailableError
from tinkerrpc._openai_client import import_openai, sidecar_connection
from tinkerrpc._retry import RetryPolicy
from tinkerrpc._sample_stream import sample_stream
from tinkerrpc._server_info import ServerInfo
from tinkerrpc._watch import AsyncEventStream, EventStream

if TYPE_CHECKING:
    import openai

T = TypeVar("T")
R = TypeVar("R")
P = ParamSpec("P")
HandleT = TypeVar("HandleT")
ClientT_co = TypeVar("ClientT_co", bound="ClientMethods[Any]", covariant=True)

# One step of a plan: what the transport runs for it.
Step = Call[T] | StreamCall[T] | Blocking[T]
# A method's plan: it yields steps, is sent each one's result (or has its grpc.RpcError raised at the
# yield), and returns the method's result.
Plan = Generator[Step[Any], Any, T]
# What a method body returns: a single call, or a plan of steps.
Sendable = Call[T] | StreamCall[T] | Plan[T]


def ask(call: Step[T]) -> Plan[T]:
    """Within a plan, `result = yield from ask(call)`: the call's result, typed."""
    result: T = yield call
    return result


def as_plan(sendable: Sendable[T]) -> Plan[T]:
    return sendable if isinstance(sendable, Generator) else ask(sendable)


class Steps(Generic[T]):
    """One run of a method: `step` is what to run next, None once the plan has returned `result`."""

    def __init__(self, sendable: Sendable[T]) -> None:
        self._plan = as_plan(sendable)
        self.step: Step[Any] | None = None
        self.result: T
        self._answer(None)

    def _answer(self, result: Any) -> None:
        """Hand the plan the result of the step just run (None to start it)."""
        self._resume(lambda: self._plan.send(result))

    @contextmanager
    def sending(self) -> Iterator[Callable[[Any], None]]:
        """Around the send of `step`: what is given to the yielded function is handed to the plan after
        the block; a grpc.RpcError of the send is raised in the plan instead, which may handle it."""
        results: list[Any] = []
        try:
            yield results.append
        except grpc.RpcError as error:
            self._resume(partial(self._plan.throw, error))
        else:
            self._answer(results[0])

    def _resume(self, resume: Callable[[], Step[Any]]) -> None:
        try:
            self.step = resume()
        except StopIteration as finished:
            self.step = None
            self.result = finished.value


def on_model(prepare: Callable[Concatenate[str, P], R]) -> Callable[Concatenate[ModelHandle[Any], P], R]:
    """A model handle's method body from a `_calls` function of the model's name."""

    def body(handle: ModelHandle[Any], /, *args: P.args, **kwargs: P.kwargs) -> R:
        return prepare(handle.name, *args, **kwargs)

    # The model name stands where the owner does: the method's own parameters follow it either way.
    _describe(body, prepare, inspect.signature(prepare))
    return body


def on_client(prepare: Callable[P, R]) -> Callable[Concatenate[Any, P], R]:
    """A client's method body from a `_calls` function that needs nothing of the client."""

    def body(client: Any, /, *args: P.args, **kwargs: P.kwargs) -> R:
        return prepare(*args, **kwargs)

    signature = inspect.signature(prepare)
    owner = inspect.Parameter("client", inspect.Parameter.POSITIONAL_ONLY)
    _describe(body, prepare, signature.replace(parameters=[owner, *signature.parameters.values()]))
    return body


def _describe(body: Callable[..., Any], prepare: Callable[..., Any], signature: inspect.Signature) -> None:
    body.__name__ = prepare.__name__
    body.__doc__ = prepare.__doc__
    body.__signature__ = signature  # type: ignore[attr-defined]


class _Described:
    """A method table entry. On a concrete class (Model, AsyncModel, Client, AsyncClient) it is a real
    function made for that class's transport, blocking or a coroutine function, with its body's
    docstring and signature (`self` for the owner, `Call[T]` shown as `T`), so that help() and inspect
    show the real API."""

    def __init__(self, body: Callable[..., Any]) -> None:
        self._body = body
        self.__doc__ = body.__doc__
        self.__name__ = getattr(body, "__name__", "method")
        self._functions: dict[type[Any], Callable[..., Any]] = {}

    def __set_name__(self, owner: type[Any], name: str) -> None:
        self.__name__ = name

    def _make(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Callable[..., Any]:
        """The function `owner.<name>` for an owner whose client is of `client_type`."""
        raise NotImplementedError

    def _returns(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Any:
        return _result_annotation(inspect.signature(self._body))

    def _get(self, owner: object, owner_type: type[Any]) -> Any:
        function = self._functions.get(owner_type)
        if function is None:
            client_type = owner_type._client_type if issubclass(owner_type, ModelHandle) else owner_type
            if not isinstance(client_type, type) or not issubclass(
                client_type, (SyncTransport, AsyncTransport)
            ):
                return self  # on the abstract bases
            function = self._functions[owner_type] = self._make(client_type)
            signature = inspect.signature(self._body)
            own, *parameters = signature.parameters.values()
            function.__name__ = self.__name__
            function.__qualname__ = f"{owner_type.__qualname__}.{self.__name__}"
            function.__module__ = owner_type.__module__
            function.__doc__ = self.__doc__
            function.__signature__ = signature.replace(  # type: ignore[attr-defined]
                parameters=[
                    own.replace(name="self", kind=_OWNER_KIND, annotation=inspect.Parameter.empty),
                    *parameters,
                ],
                return_annotation=self._returns(client_type),
            )
        return function if owner is None else MethodType(function, owner)


# Shown as a plain `self`, as in a method written out.
_OWNER_KIND = inspect.Parameter.POSITIONAL_OR_KEYWORD


def _result_annotation(signature: inspect.Signature) -> Any:
    # With postponed annotations the return annotation is the source text, e.g. "Call[list[Sample]]".
    returns = signature.return_annotation
    if not isinstance(returns, str):
        return returns
    for wrapper in ("Call[", "StreamCall[", "WatchCall[", "Plan["):
        if returns.startswith(wrapper) and returns.endswith("]"):
            return returns.removeprefix(wrapper).removesuffix("]")
    return returns


def _client(owner: object) -> Any:
    """The transport that runs `owner`'s methods: the client itself, or a handle's client."""
    return owner.client if isinstance(owner, ModelHandle) else owner


class Method(_Described, Generic[P, T]):
    """A method of a client or a model handle: blocking on Client and Model, a coroutine on AsyncClient
    and AsyncModel."""

    def __init__(self, body: Callable[Concatenate[Any, P], Sendable[T]]) -> None:
        super().__init__(body)

    @overload
    def __get__(self, owner: None, owner_type: type[Any]) -> Method[P, T]: ...
    @overload
    def __get__(
        self, owner: SyncTransport[Any] | ModelHandle[SyncTransport[Any]], owner_type: type[Any]
    ) -> Callable[P, T]: ...
    @overload
    def __get__(
        self, owner: AsyncTransport[Any] | ModelHandle[AsyncTransport[Any]], owner_type: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, T]]: ...
    def __get__(self, owner: object, owner_type: type[Any]) -> Any:
        return self._get(owner, owner_type)

    def _make(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Callable[..., Any]:
        return client_type._method_of(self._body)


class Watch(_Described, Generic[P, T]):
    """A method that opens an event stream: an EventStream on Model, an AsyncEventStream on AsyncModel
    (not a coroutine: `async for event in model.watch(...)`; the call starts with the first event)."""

    def __init__(self, body: Callable[Concatenate[Any, P], WatchCall[T]]) -> None:
        super().__init__(body)

    @overload
    def __get__(self, owner: None, owner_type: type[Any]) -> Watch[P, T]: ...
    @overload
    def __get__(
        self, owner: ModelHandle[SyncTransport[Any]], owner_type: type[Any]
    ) -> Callable[P, EventStream[T]]: ...
    @overload
    def __get__(
        self, owner: ModelHandle[AsyncTransport[Any]], owner_type: type[Any]
    ) -> Callable[P, AsyncEventStream[T]]: ...
    def __get__(self, owner: object, owner_type: type[Any]) -> Any:
        return self._get(owner, owner_type)

    def _make(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Callable[..., Any]:
        def method(owner: object, /, *args: Any, **kwargs: Any) -> Any:
            return _client(owner)._watch(self._body(owner, *args, **kwargs))

        return method

    def _returns(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Any:
        stream = "AsyncEventStream" if issubclass(client_type, AsyncTransport) else "EventStream"
        return f"{stream}[{super()._returns(client_type)}]"


class OpensModel(_Described, Generic[P]):
    """A client method that returns the handle (Model or AsyncModel) of the model its call names."""

    def __init__(self, body: Callable[Concatenate[Any, P], Sendable[str]]) -> None:
        super().__init__(body)

    @overload
    def __get__(self, owner: None, owner_type: type[Any]) -> OpensModel[P]: ...
    @overload
    def __get__(self, owner: SyncTransport[HandleT], owner_type: type[Any]) -> Callable[P, HandleT]: ...
    @overload
    def __get__(
        self, owner: AsyncTransport[HandleT], owner_type: type[Any]
    ) -> Callable[P, Coroutine[Any, Any, HandleT]]: ...
    def __get__(self, owner: object, owner_type: type[Any]) -> Any:
        return self._get(owner, owner_type)

    def _make(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Callable[..., Any]:
        def opened(client: ClientMethods[Any], /, *args: Any, **kwargs: Any) -> Plan[Any]:
            name = yield from as_plan(self._body(client, *args, **kwargs))
            return client.model(name)

        return client_type._method_of(opened)

    def _returns(self, client_type: type[SyncTransport[Any] | AsyncTransport[Any]]) -> Any:
        return inspect.signature(client_type._handle).return_annotation


class ModelHandle(Generic[ClientT_co]):
    """A handle on one model of a client: the client and the model's name. Cheap to create; every
    method is one RPC (or, for the OpenAI clients, the server-info call they need)."""

    # The client class whose transport runs the methods (class keyword `client_type=`).
    _client_type: type[ClientMethods[Any]] | None = None

    def __init__(self, client: ClientT_co, name: str) -> None:
        self.client = client
        self.name = name

    def __init_subclass__(cls, *, client_type: type[ClientMethods[Any]] | None = None, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        if client_type is not None:
            cls._client_type = client_type

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.name!r})"

    info = Method(on_model(calls.get_model))
    sample = Method(on_model(calls.sample))
    train = Method(on_model(calls.train))
    train_supervised = Method(on_model(calls.train_supervised))
    save_checkpoint = Method(on_model(calls.save_checkpoint))
    checkpoints = Method(on_model(calls.checkpoints))
    restore = Method(on_model(calls.restore))
    delete_checkpoint = Method(on_model(calls.delete_checkpoint))
    export_weights = Method(on_model(calls.export_weights))
    history = Method(on_model(calls.history))
    watch = Watch(on_model(calls.watch))
    sample_stream = Watch(on_model(sample_stream))

    @Method
    def openai_client(
        self, /, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> Plan[openai.OpenAI]:
        """An `openai.OpenAI` client on the server's hosted sidecar (the URL from GetServerInfo, or
        `sidecar_url=` for a standalone one), with `api_key=` or $TINKERRPC_SIDECAR_API_KEY. Requests
        pass `model=model.name`: the openai client has no default model. `openai_options` go to
        `openai.OpenAI` (timeout, max_retries, ...). Needs `pip install 'tinkerrpc[openai]'`."""
        base_url, key = yield from self._sidecar(sidecar_url, api_key)
        client: openai.OpenAI = import_openai().OpenAI(base_url=base_url, api_key=key, **openai_options)
        return client

    @Method
    def async_openai_client(
        self, /, *, api_key: str | None = None, sidecar_url: str | None = None, **openai_options: Any
    ) -> Plan[openai.AsyncOpenAI]:
        """As `openai_client`, an `openai.AsyncOpenAI`."""
        base_url, key = yield from self._sidecar(sidecar_url, api_key)
        client: openai.AsyncOpenAI = import_openai().AsyncOpenAI(
            base_url=base_url, api_key=key, **openai_options
        )
        return client

    def _sidecar(self, sidecar_url: str | None, api_key: str | None) -> Plan[tuple[str, str]]:
        info = None if sidecar_url else (yield from ask(calls.server_info(self.client.target)))
        return sidecar_connection(info, sidecar_url, api_key)


class ClientMethods(ABC, Generic[HandleT]):
    """The methods of a client that are not a model's."""

    target: str
    timeout: float | None
    retry: RetryPolicy
    _tls: bool
    _metadata: Metadata

    def _configure(
        self,
        target: str,
        token: str | None,
        tls: TlsOption,
        tls_server_name: str | None,
        timeout: float | None,
        retry: RetryPolicy | None,
        max_message_bytes: int,
    ) -> tuple[grpc.ChannelCredentials | None, list[tuple[str, int | str]]]:
        """Check and keep the options both clients take (see Client); returns the channel's credentials
        (None: plaintext) and options."""
        check_target(target)
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self._metadata = auth_metadata(token)
        credentials = channel_credentials(tls)
        self._tls = credentials is not None
        return credentials, channel_options(max_message_bytes, tls_server_name)

    def model(self, name: str) -> HandleT:
        """A handle on an existing model; no network call."""
        if not name:
            raise ValueError("model name must not be empty")
        return self._handle(name)

    @abstractmethod
    def _handle(self, name: str) -> HandleT:
        """The client's handle (Model or AsyncModel) on model `name`."""

    def _health_options(self, check: Call[Any]) -> dict[str, Any]:
        """The options of a health check's one attempt (no retry: its plan decides what a failure means)."""
        return {"timeout": check.timeout, "metadata": self._metadata, "wait_for_ready": check.wait_for_ready}

    create_model = OpensModel(on_client(calls.create_model))
    get_model = Method(on_client(calls.get_model))
    list_models = Method(on_client(calls.list_models))
    delete_model = Method(on_client(calls.delete_model))

    @Method
    def wait_until_serving(self, /, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> Plan[None]:
        """Wait for the connection and check gRPC health; UnavailableError unless SERVING within `timeout`."""
        deadline = time.monotonic() + timeout
        last_error: grpc.RpcError | None = None
        for service in HEALTH_SERVICE_NAMES:
            try:
                response = yield from self._check_health(service, deadline)
            except grpc.RpcError as error:
                last_error = error
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise unreachable(self.target, timeout, error) from error
            check_serving(self.target, service, response)
            return
        assert last_error is not None
        raise unreachable(self.target, timeout, last_error) from last_error

    def _check_health(self, service: str, deadline: float) -> Plan[health_pb2.HealthCheckResponse]:
        """One health check. It first fails fast when the connection does, so that a refused port or an
        HTTP server is named at once; only a server the probe cannot explain is waited for."""
        try:
            return (yield from ask(calls.health_check(service, deadline=deadline, wait_for_ready=False)))
        except grpc.RpcError as error:
            if error.code() != grpc.StatusCode.UNAVAILABLE:
                raise
            probe = Blocking(partial(first_contact_problem, self.target, self._tls))
            problem = yield from ask(probe)
            if problem is not None:
                raise UnavailableError(grpc.StatusCode.UNAVAILABLE, problem) from error
        return (yield from ask(calls.health_check(service, deadline=deadline, wait_for_ready=True)))

    @Method
    def server_info(self, /, *, timeout: float | None = None) -> Call[ServerInfo]:
        """The server's version, backend, hosted OpenAI sidecar URL and request limits."""
        return calls.server_info(self.target, timeout=timeout)


class SyncTransport(ClientMethods[HandleT]):
    """A client whose methods block: it sends one call at a time and returns its result."""

    @abstractmethod
    def _send(self, step: Step[T]) -> T: ...

    @abstractmethod
    def _watch(self, call: WatchCall[T]) -> EventStream[T]: ...

    def _run(self, sendable: Sendable[T]) -> T:
        steps = Steps(sendable)
        while steps.step is not None:
            with steps.sending() as answer:
                answer(self._send(steps.step))
        return steps.result

    @staticmethod
    def _method_of(body: Callable[..., Sendable[Any]]) -> Callable[..., Any]:
        """`body` as a blocking method of the client or of its model handle."""

        def method(owner: object, /, *args: Any, **kwargs: Any) -> Any:
            client: SyncTransport[Any] = _client(owner)
            return client._run(body(owner, *args, **kwargs))

        return method


class AsyncTransport(ClientMethods[HandleT]):
    """A client whose methods are coroutines: it awaits one call at a time."""

    @abstractmethod
    async def _send(self, step: Step[T]) -> T: ...

    @abstractmethod
    def _watch(self, call: WatchCall[T]) -> AsyncEventStream[T]: ...

    async def _run(self, sendable: Sendable[T]) -> T:
        steps = Steps(sendable)
        while steps.step is not None:
            with steps.sending() as answer:
                answer(await self._send(steps.step))
        return steps.result

    @staticmethod
    def _method_of(body: Callable[..., Sendable[Any]]) -> Callable[..., Any]:
        """`body` as a coroutine method of the client or of its model handle."""

        async def method(owner: object, /, *args: Any, **kwargs: Any) -> Any:
            client: AsyncTransport[Any] = _client(owner)
            return await client._run(body(owner, *args, **kwargs))

        return method
