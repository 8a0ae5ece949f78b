"""What the gRPC server checks before a call reaches its service: the bearer token (every RPC but health
checking needs it) and that the request decodes at all (invalid UTF-8 in a string field is the client's
error, INVALID_ARGUMENT, not an UNKNOWN with a traceback in the log)."""

from __future__ import annotations

import hmac
import inspect
from collections.abc import Awaitable, Callable
from typing import Any

import grpc
from google.protobuf.message import DecodeError

from tinkerrpc_server.service import errors

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


def _token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, expected: bytes) -> bool:
    for key, value in metadata or ():
        if key == "authorization":
            given = value.encode() if isinstance(value, str) else value
            # Constant-time: the comparison must not reveal how much of the token was right.
            return hmac.compare_digest(given, expected)
    return False


Behaviour = Callable[[Any, grpc.aio.ServicerContext[Any, Any]], Any]

_HANDLER_MAKERS = {
    (False, False): grpc.unary_unary_rpc_method_handler,
    (True, False): grpc.stream_unary_rpc_method_handler,
    (False, True): grpc.unary_stream_rpc_method_handler,
    (True, True): grpc.stream_stream_rpc_method_handler,
}


def _replaced(
    handler: grpc.RpcMethodHandler[Any, Any],
    behaviour: Behaviour,
    request_deserializer: Callable[[bytes], Any] | None,
) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` running `behaviour` (for a streaming response: an async
    generator function, or a coroutine function that writes its responses to the context) on requests
    decoded by `request_deserializer`."""
    make = _HANDLER_MAKERS[(handler.request_streaming, handler.response_streaming)]
    return make(
        behaviour,
        request_deserializer=request_deserializer,
        response_serializer=handler.response_serializer,
    )


def _aborting(handler: grpc.RpcMethodHandler[Any, Any], abort: Behaviour) -> Behaviour:
    """`abort` shaped as `handler`'s behaviour (an async generator when the response streams)."""

    async def abort_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await abort(request, context)
        yield  # pragma: no cover - abort raised above; this makes the function an async generator

    return abort_stream if handler.response_streaming else abort


def _refusal(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token (metadata `authorization: Bearer <token>`)",
        )

    return _replaced(handler, _aborting(handler, refuse), handler.request_deserializer)


# Generic only in grpc-stubs: at run time grpc.aio.ServerInterceptor cannot be subscripted.
class BearerTokenInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Refuses every call without `authorization: Bearer <token>`, except gRPC health checks."""

    def __init__(self, token: str) -> None:
        self._expected = f"Bearer {token}".encode()

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        if handler is None or handler_call_details.method.startswith(HEALTH_METHOD_PREFIX):
            return handler
        if _token_matches(handler_call_details.invocation_metadata, self._expected):
            return handler
        return _refusal(handler)


class _Undecodable:
    """Stands in for a request that did not decode, so the call can answer why."""

    def __init__(self, error: DecodeError) -> None:
        self.error = error


class RequestDecodingInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[type-arg]
    """Answers INVALID_ARGUMENT (a BadRequest naming `request`) to a request that is not a valid
    encoding of the method's request message, e.g. invalid UTF-8 in a string field."""

    async def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Awaitable[grpc.RpcMethodHandler[Any, Any]]],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> grpc.RpcMethodHandler[Any, Any]:
        handler = await continuation(handler_call_details)
        decode = handler.request_deserializer if handler is not None else None
        if handler is None or decode is None or handler.request_streaming:
            return handler  # no such method; or nothing to decode; no streaming requests are served

        def decode_or_mark(data: bytes) -> Any:
            try:
                return decode(data)
            except DecodeError as error:
                return _Undecodable(error)

        async def refuse(error: DecodeError, context: grpc.aio.ServicerContext[Any, Any]) -> None:
            invalid = errors.invalid_argument(
                [("request", f"not a valid {handler_call_details.method} request: {error}")]
            )
            # grpc-stubs' aio.ServicerContext lacks abort_with_status (grpc.aio has it since 1.38).
            await context.abort_with_status(invalid.to_status())  # type: ignore[attr-defined]

        # grpc.aio tells a coroutine handler from an async generator one by inspection: the wrappers keep
        # the kind of the method they wrap.
        if handler.response_streaming:
            serve_stream = handler.unary_stream
            assert serve_stream is not None

            if not inspect.isasyncgenfunction(serve_stream):
                # A handler that writes its responses itself (health checking's Watch: context.write).
                async def behaviour_writes(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                    if isinstance(request, _Undecodable):
                        await refuse(request.error, context)
                    return await serve_stream(request, context)  # type: ignore[arg-type,misc]

                return _replaced(handler, behaviour_writes, decode_or_mark)

            async def behaviour_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
                if isinstance(request, _Undecodable):
                    await refuse(request.error, context)
                async for response in serve_stream(request, context):  # type: ignore[arg-type]
                    yield response

            return _replaced(handler, behaviour_stream, decode_or_mark)
        serve = handler.unary_unary
        assert serve is not None

        async def behaviour(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
            if isinstance(request, _Undecodable):
                await refuse(request.error, context)
            return await serve(request, context)  # type: ignore[arg-type]

        return _replaced(handler, behaviour, decode_or_mark)
