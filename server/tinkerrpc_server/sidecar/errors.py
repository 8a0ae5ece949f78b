"""OpenAI-shaped errors, and the single place where gRPC status codes become HTTP statuses."""

from __future__ import annotations

import re
from dataclasses import dataclass

import grpc
from fastapi.responses import JSONResponse

from tinkerrpc import InvalidArgumentError, RPCError

# Headers the `openai` client reads to decide whether to retry (it honours them over its own rules).
SHOULD_RETRY_HEADER = "x-should-retry"


@dataclass(frozen=True)
class HttpMapping:
    status: int
    error_type: str
    should_retry: bool


# gRPC status → HTTP status, OpenAI error type, and whether an identical retry can succeed.
GRPC_TO_HTTP: dict[grpc.StatusCode, HttpMapping] = {
    grpc.StatusCode.INVALID_ARGUMENT: HttpMapping(400, "invalid_request_error", False),
    grpc.StatusCode.OUT_OF_RANGE: HttpMapping(400, "invalid_request_error", False),
    grpc.StatusCode.FAILED_PRECONDITION: HttpMapping(400, "invalid_request_error", False),
    grpc.StatusCode.NOT_FOUND: HttpMapping(404, "invalid_request_error", False),
    grpc.StatusCode.ALREADY_EXISTS: HttpMapping(409, "invalid_request_error", False),
    grpc.StatusCode.ABORTED: HttpMapping(409, "server_error", True),
    grpc.StatusCode.PERMISSION_DENIED: HttpMapping(403, "permission_error", False),
    # The caller's key was accepted by the sidecar; the gRPC server refusing the sidecar's own
    # token is a misconfigured gateway, not the caller's fault.
    grpc.StatusCode.UNAUTHENTICATED: HttpMapping(502, "server_error", False),
    grpc.StatusCode.RESOURCE_EXHAUSTED: HttpMapping(429, "rate_limit_error", True),
    grpc.StatusCode.UNAVAILABLE: HttpMapping(503, "service_unavailable", True),
    grpc.StatusCode.DEADLINE_EXCEEDED: HttpMapping(504, "timeout", True),
    grpc.StatusCode.CANCELLED: HttpMapping(499, "server_error", False),
    grpc.StatusCode.UNIMPLEMENTED: HttpMapping(501, "server_error", False),
}
UNMAPPED_GRPC = HttpMapping(500, "server_error", False)


class OpenAIError(Exception):
    """An error answered in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}`."""

    def __init__(
        self,
        status: int,
        message: str,
        *,
        param: str | None = None,
        code: str | None = None,
        error_type: str = "invalid_request_error",
        should_retry: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type
        self.should_retry = should_retry

    def body(self) -> dict[str, dict[str, str | None]]:
        return {
            "error": {
                "message": self.message,
                "type": self.error_type,
                "param": self.param,
                "code": self.code,
            }
        }

    def to_response(self) -> JSONResponse:
        body = self.body()
        headers = {SHOULD_RETRY_HEADER: "true" if self.should_retry else "false"}
        if self.status == 401:
            headers["www-authenticate"] = "Bearer"
        return JSONResponse(body, status_code=self.status, headers=headers)


def bad_request(message: str, param: str | None, code: str | None = None) -> OpenAIError:
    return OpenAIError(400, message, param=param, code=code)


def model_not_found(model: str, reason: str) -> OpenAIError:
    return OpenAIError(
        404, f"The model `{model}` does not exist: {reason}", param="model", code="model_not_found"
    )


# The server's field choosing the renderer's thinking variant, and its name in a chat request (vLLM's
# chat_template_kwargs; the chat route names reasoning_effort instead when that alone chose it).
THINKING_FIELD = "chat.enable_thinking"
THINKING_PARAM = "chat_template_kwargs.enable_thinking"

# Server-side field paths of a SampleRequest, as the OpenAI request names them.
_PROTO_FIELD_TO_PARAM: tuple[tuple[str, str], ...] = (
    ("params.", ""),
    ("chat.messages", "messages"),
    ("chat.tools", "tools"),
    (THINKING_FIELD, THINKING_PARAM),
    ("tokens.token_ids", "prompt"),
    ("text", "prompt"),
    ("policy_version", "model"),
)


def param_from_proto_field(field: str) -> str:
    for prefix, replacement in _PROTO_FIELD_TO_PARAM:
        if field.startswith(prefix):
            return replacement + field[len(prefix) :]
    return field


def from_rpc_error(error: RPCError, model: str) -> OpenAIError:
    """The HTTP answer to a failed gRPC call (the only gRPC → HTTP translation in the sidecar)."""
    if error.code == grpc.StatusCode.NOT_FOUND:
        return model_not_found(model, error.message)
    mapping = GRPC_TO_HTTP.get(error.code, UNMAPPED_GRPC)
    param: str | None = None
    if isinstance(error, InvalidArgumentError) and error.field_violations:
        param = param_from_proto_field(error.field_violations[0][0])
    message = f"{error.message} (gRPC {error.code.name})"
    return OpenAIError(
        mapping.status,
        message,
        param=param,
        code=error.code.name.lower(),
        error_type=mapping.error_type,
        should_retry=mapping.should_retry,
    )


_LOC_INDEX = re.compile(r"\.(\d+)(?=\.|$)")


def param_from_loc(loc: tuple[int | str, ...]) -> str | None:
    """A pydantic error location (after its "body" root) as a parameter path: `messages[0].content`."""
    parts = [str(p) for p in loc if p != "body"]
    if not parts:
        return None
    # Union members appear as pseudo-fields such as `str` or `list[int]`; they are not parameters.
    parts = [p for p in parts if not (p[0].isalpha() and ("[" in p or p in _TYPE_NAMES))]
    return _LOC_INDEX.sub(r"[\1]", ".".join(parts)) or None


_TYPE_NAMES = frozenset({"str", "int", "float", "bool", "list", "dict", "none", "function-after"})
