"""Bearer-token authentication for the gRPC server: every RPC but health checking needs the token."""

from __future__ import annotations

import hmac
from collections.abc import Awaitable, Callable
from typing import Any

import grpc

HEALTH_METHOD_PREFIX = "/grpc.health.v1.Health/"


def _token_matches(metadata: tuple[tuple[str, str | bytes], ...] | None, expected: bytes) -> bool:
    for key, value in metadata or ():
        if key == "authorization":
            given = value.encode() if isinstance(value, str) else value
            # Constant-time: the comparison must not reveal how much of the token was right.
            return hmac.compare_digest(given, expected)
    return False


def _refusal(handler: grpc.RpcMethodHandler[Any, Any]) -> grpc.RpcMethodHandler[Any, Any]:
    """A handler of the same kind as `handler` that answers UNAUTHENTICATED."""

    async def refuse(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await context.abort(
            grpc.StatusCode.UNAUTHENTICATED,
            "missing or wrong bearer token (metadata `authorization: Bearer <token>`)",
        )

    async def refuse_stream(request: Any, context: grpc.aio.ServicerContext[Any, Any]) -> Any:
        await refuse(request, context)
        yield  # pragma: no cover - abort raised above; this makes the function an async generator

    kinds = {
        (False, False): grpc.unary_unary_rpc_method_handler,
        (True, False): grpc.stream_unary_rpc_method_handler,
        (False, True): grpc.unary_stream_rpc_method_handler,
        (True, True): grpc.stream_stream_rpc_method_handler,
    }
    make = kinds[(handler.request_streaming, handler.response_streaming)]
    behaviour = refuse_stream if handler.response_streaming else refuse
    return make(
        behaviour,
        request_deserializer=handler.request_deserializer,
        response_serializer=handler.response_serializer,
    )


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
