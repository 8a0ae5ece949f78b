"""Typed errors decoded from gRPC status codes and google.rpc details."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import NoReturn, cast

import grpc
from google.protobuf import any_pb2
from google.protobuf.message import DecodeError
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2  # type: ignore[import-untyped]

from tinkerrpc.v1.errors_pb2 import ErrorReason

STATUS_DETAILS_KEY = "grpc-status-details-bin"
# ErrorInfo.reason is an ErrorReason's name without this prefix (errors.proto).
_REASON_PREFIX = "ERROR_REASON_"

# The standard google.rpc detail types, unpacked from their Any wrappers.
_DETAIL_TYPES: dict[str, type[ProtoMessage]] = {
    cls.DESCRIPTOR.full_name: cls
    for cls in (
        error_details_pb2.BadRequest,
        error_details_pb2.ErrorInfo,
        error_details_pb2.ResourceInfo,
        error_details_pb2.PreconditionFailure,
        error_details_pb2.RetryInfo,
        error_details_pb2.DebugInfo,
        error_details_pb2.QuotaFailure,
        error_details_pb2.RequestInfo,
        error_details_pb2.Help,
        error_details_pb2.LocalizedMessage,
    )
}


class RPCError(Exception):
    """A failed tinkerrpc call: the gRPC status code, its message and the decoded google.rpc details."""

    def __init__(self, code: grpc.StatusCode, message: str, details: Sequence[ProtoMessage] = ()) -> None:
        super().__init__(f"{code.name}: {message}")
        self.code = code
        self.message = message
        self.details: list[ProtoMessage] = list(details)

    def detail(self, detail_type: type[ProtoMessage]) -> ProtoMessage | None:
        """The first detail of the given type, if any."""
        return next((d for d in self.details if isinstance(d, detail_type)), None)

    @property
    def error_info(self) -> error_details_pb2.ErrorInfo | None:
        info = self.detail(error_details_pb2.ErrorInfo)
        return info if isinstance(info, error_details_pb2.ErrorInfo) else None

    @property
    def reason(self) -> ErrorReason.ValueType | None:
        """Why the server refused the call, from its ErrorInfo (None without one); ERROR_REASON_UNSPECIFIED
        for a reason newer than this SDK."""
        info = self.error_info
        return _reason(info) if info is not None else None


class InvalidArgumentError(RPCError):
    """INVALID_ARGUMENT; `field_violations` lists (field, description) from google.rpc.BadRequest."""

    @property
    def field_violations(self) -> list[tuple[str, str]]:
        return [
            (v.field, v.description)
            for d in self.details
            if isinstance(d, error_details_pb2.BadRequest)
            for v in d.field_violations
        ]


class NotFoundError(RPCError):
    """NOT_FOUND: an unknown model, checkpoint or policy version."""


class AlreadyExistsError(RPCError):
    """ALREADY_EXISTS: e.g. a model name in use."""


class FailedPreconditionError(RPCError):
    """FAILED_PRECONDITION: the request is valid but the model's state refuses it."""


class StalePolicyError(FailedPreconditionError):
    """Trajectories sampled too many versions ago under strict staleness (ERROR_REASON_STALE_POLICY_VERSION)."""

    @property
    def current_version(self) -> int | None:
        return self._version("current_version")

    @property
    def sampled_version(self) -> int | None:
        return self._version("sampled_version")

    def _version(self, key: str) -> int | None:
        info = self.error_info
        value = info.metadata.get(key) if info is not None else None
        return int(value) if value is not None else None


class UnauthenticatedError(RPCError):
    """UNAUTHENTICATED: a missing or wrong bearer token."""


class ResourceExhaustedError(RPCError):
    """RESOURCE_EXHAUSTED: a request over a size limit, or the server is out of capacity."""


class UnavailableError(RPCError):
    """UNAVAILABLE: the server is unreachable or (re)starting; retried automatically before surfacing."""


_CLASS_BY_CODE: dict[grpc.StatusCode, type[RPCError]] = {
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: AlreadyExistsError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
}


def decode_details(status_bytes: bytes) -> list[ProtoMessage]:
    """The details of a serialized google.rpc.Status; unknown types stay as Any, garbage yields none."""
    status = status_pb2.Status()
    try:
        status.ParseFromString(status_bytes)
    except DecodeError:
        return []
    details: list[ProtoMessage] = []
    for packed in status.details:
        detail_type = _DETAIL_TYPES.get(packed.TypeName())
        if detail_type is None:
            details.append(any_pb2.Any(type_url=packed.type_url, value=packed.value))
            continue
        detail = detail_type()
        packed.Unpack(detail)
        details.append(detail)
    return details


def _reason(info: error_details_pb2.ErrorInfo) -> ErrorReason.ValueType:
    try:
        return ErrorReason.Value(_REASON_PREFIX + info.reason)
    except ValueError:  # a reason added after this SDK was built
        return ErrorReason.ERROR_REASON_UNSPECIFIED


def error_from_status(code: grpc.StatusCode, message: str, details: Sequence[ProtoMessage]) -> RPCError:
    """The most specific RPCError subclass for a status."""
    if code == grpc.StatusCode.FAILED_PRECONDITION and any(
        isinstance(d, error_details_pb2.ErrorInfo)
        and _reason(d) == ErrorReason.ERROR_REASON_STALE_POLICY_VERSION
        for d in details
    ):
        return StalePolicyError(code, message, details)
    return _CLASS_BY_CODE.get(code, RPCError)(code, message, details)


def raise_for_rpc_error(error: grpc.RpcError) -> NoReturn:
    """Re-raise a grpc (sync or aio) call error as a typed RPCError; used by both clients."""
    # Sync errors are also grpc.Call objects and aio errors are AioRpcError: both expose these.
    code = error.code()
    message = error.details() or ""
    trailers = cast("Iterable[tuple[str, str | bytes]]", error.trailing_metadata() or ())
    status_bytes = next((value for key, value in trailers if key == STATUS_DETAILS_KEY), None)
    details = decode_details(status_bytes) if isinstance(status_bytes, bytes) else []
    raise error_from_status(code, message, details) from error
