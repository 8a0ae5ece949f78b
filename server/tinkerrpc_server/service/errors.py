"""Service errors: a canonical gRPC status code plus google.rpc details, raised anywhere in the service
and turned into the call's status in one place (see `abort_with`)."""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence

import grpc
import tinker
from google.protobuf import any_pb2
from google.protobuf.message import Message as ProtoMessage
from google.rpc import code_pb2, error_details_pb2, status_pb2  # type: ignore[import-untyped]
from grpc_status import rpc_status

from tinkerrpc.v1.errors_pb2 import ErrorReason

ERROR_DOMAIN = "tinkerrpc"

# ErrorInfo reasons: the public contract is ErrorReason in errors.proto, which documents each one.
STALE_POLICY_VERSION = ErrorReason.ERROR_REASON_STALE_POLICY_VERSION
VERSION_MISMATCH = ErrorReason.ERROR_REASON_VERSION_MISMATCH
NO_CURRENT_STATE = ErrorReason.ERROR_REASON_NO_CURRENT_STATE
IDEMPOTENCY_KEY_REUSED = ErrorReason.ERROR_REASON_IDEMPOTENCY_KEY_REUSED
NOTHING_TO_TRAIN = ErrorReason.ERROR_REASON_NOTHING_TO_TRAIN
CURRENT_SAMPLER_CHECKPOINT = ErrorReason.ERROR_REASON_CURRENT_SAMPLER_CHECKPOINT
RECOVERY_CHECKPOINT = ErrorReason.ERROR_REASON_RECOVERY_CHECKPOINT
NON_FINITE_UPDATE = ErrorReason.ERROR_REASON_NON_FINITE_UPDATE
REFERENCE_NOT_KEPT = ErrorReason.ERROR_REASON_REFERENCE_NOT_KEPT
TOO_MANY_REFERENCE_PINS = ErrorReason.ERROR_REASON_TOO_MANY_REFERENCE_PINS

# A status travels in grpc-message and grpc-status-details-bin, metadata of at most 8 KiB by default:
# whatever a request echoes (a name, a value) is cut short so the status itself always fits.
MAX_SHOWN_CHARS = 64
MAX_MESSAGE_CHARS = 1024
MAX_REPORTED_VIOLATIONS = 20


def shown(value: str) -> str:
    """`value` quoted for an error message, its first MAX_SHOWN_CHARS characters only."""
    if len(value) <= MAX_SHOWN_CHARS:
        return repr(value)
    return f"{value[:MAX_SHOWN_CHARS]!r}… ({len(value)} characters)"


def _bounded(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    return text if len(text) <= limit else f"{text[:limit]}… ({len(text)} characters)"


class ServiceError(Exception):
    """A failed RPC: status code, message and google.rpc detail messages."""

    def __init__(self, code: grpc.StatusCode, message: str, details: Sequence[ProtoMessage] = ()) -> None:
        message = _bounded(message)
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = list(details)

    def to_status(self) -> grpc.Status:
        packed = []
        for detail in self.details:
            wrapper = any_pb2.Any()
            wrapper.Pack(detail)
            packed.append(wrapper)
        proto = status_pb2.Status(code=_CODE_NUMBERS[self.code], message=self.message, details=packed)
        return rpc_status.to_status(proto)


_CODE_NUMBERS: dict[grpc.StatusCode, int] = {code: code.value[0] for code in grpc.StatusCode}
assert _CODE_NUMBERS[grpc.StatusCode.INVALID_ARGUMENT] == code_pb2.INVALID_ARGUMENT


class Violations:
    """Collects BadRequest field violations; `raise_if_any` turns them into one INVALID_ARGUMENT."""

    def __init__(self) -> None:
        self.items: list[tuple[str, str]] = []

    def add(self, field: str, description: str) -> None:
        self.items.append((field, description))

    def raise_if_any(self) -> None:
        if self.items:
            raise invalid_argument(self.items)


def invalid_argument(violations: Sequence[tuple[str, str]]) -> ServiceError:
    """The first MAX_REPORTED_VIOLATIONS violations go into the BadRequest (a batch of thousands of bad
    trajectories would not fit in a status); the message counts the rest."""
    bad_request = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(
                field=_bounded(field, MAX_SHOWN_CHARS * 2), description=_bounded(description, 256)
            )
            for field, description in violations[:MAX_REPORTED_VIOLATIONS]
        ]
    )
    summary = "; ".join(f"{field}: {description}" for field, description in violations[:5])
    more = f" (and {len(violations) - 5} more)" if len(violations) > 5 else ""
    return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"invalid request: {summary}{more}", [bad_request])


def not_found(resource_type: str, resource_name: str, message: str) -> ServiceError:
    info = error_details_pb2.ResourceInfo(
        resource_type=resource_type, resource_name=_bounded(resource_name, MAX_SHOWN_CHARS)
    )
    return ServiceError(grpc.StatusCode.NOT_FOUND, message, [info])


def already_exists(resource_type: str, resource_name: str, message: str) -> ServiceError:
    info = error_details_pb2.ResourceInfo(
        resource_type=resource_type, resource_name=_bounded(resource_name, MAX_SHOWN_CHARS)
    )
    return ServiceError(grpc.StatusCode.ALREADY_EXISTS, message, [info])


def deadline_exceeded(message: str) -> ServiceError:
    return ServiceError(grpc.StatusCode.DEADLINE_EXCEEDED, message)


def resource_exhausted(subject: str, message: str) -> ServiceError:
    """A request over one of the server's size limits (`subject` names the limit's flag)."""
    quota = error_details_pb2.QuotaFailure(
        violations=[error_details_pb2.QuotaFailure.Violation(subject=subject, description=message)]
    )
    return ServiceError(grpc.StatusCode.RESOURCE_EXHAUSTED, message, [quota])


def failed_precondition(
    reason: ErrorReason.ValueType, message: str, metadata: Mapping[str, object] | None = None
) -> ServiceError:
    info = error_details_pb2.ErrorInfo(
        reason=_wire_reason(reason),
        domain=ERROR_DOMAIN,
        metadata={k: _bounded(str(v), MAX_SHOWN_CHARS) for k, v in (metadata or {}).items()},
    )
    return ServiceError(grpc.StatusCode.FAILED_PRECONDITION, message, [info])


def _wire_reason(reason: ErrorReason.ValueType) -> str:
    """ErrorInfo.reason as errors.proto defines it: the ErrorReason's name without its prefix."""
    return ErrorReason.Name(reason).removeprefix("ERROR_REASON_")


# The embedded engine's message for an optimizer step it refused because its loss, gradients or updated
# weights were not finite (it kept its weights and optimizer state) starts with the reason's wire name;
# the SDK wraps it in "Request failed: <message> for self.request_id=...".
_NON_FINITE_UPDATE_MESSAGE = re.compile(
    rf"\b{_wire_reason(NON_FINITE_UPDATE)}: (?P<detail>.*?)(?: for self\.request_id=.*)?$", re.DOTALL
)


def _non_finite_detail(error: Exception) -> str | None:
    if not (
        isinstance(error, tinker.RequestFailedError)
        and error.category == tinker.types.RequestErrorCategory.User
    ):
        return None
    match = _NON_FINITE_UPDATE_MESSAGE.search(error.message)
    return match.group("detail") if match else None


def is_non_finite_update(error: Exception) -> bool:
    return _non_finite_detail(error) is not None


def non_finite_update(detail: str) -> ServiceError:
    return failed_precondition(
        NON_FINITE_UPDATE,
        f"the step was not applied: {detail}. The model keeps its version, weights and optimizer state; "
        "lower the learning rate or check the rewards and sampling logprobs",
    )


def from_tinker(error: Exception) -> ServiceError | None:
    """Map a tinker SDK error to a status: the caller's fault → INVALID_ARGUMENT, unreachable → UNAVAILABLE."""
    if isinstance(error, tinker.APIConnectionError):
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"Tinker backend unreachable: {error}")
    non_finite = _non_finite_detail(error)
    if non_finite is not None:
        return non_finite_update(non_finite)
    if isinstance(error, tinker.RequestFailedError):
        if error.category == tinker.types.RequestErrorCategory.User:
            return ServiceError(
                grpc.StatusCode.INVALID_ARGUMENT, f"rejected by the Tinker backend: {error.message}"
            )
        return ServiceError(grpc.StatusCode.INTERNAL, f"Tinker backend failed: {error.message}")
    if isinstance(error, tinker.APIStatusError):
        if error.status_code in (401, 403):
            return ServiceError(grpc.StatusCode.PERMISSION_DENIED, f"Tinker backend refused access: {error}")
        if error.status_code == 404:
            return ServiceError(grpc.StatusCode.NOT_FOUND, f"Tinker backend: {error}")
        if error.status_code == 429:
            return ServiceError(
                grpc.StatusCode.RESOURCE_EXHAUSTED, f"Tinker backend is rate limiting: {error}"
            )
        if 400 <= error.status_code < 500:
            return ServiceError(grpc.StatusCode.INVALID_ARGUMENT, f"rejected by the Tinker backend: {error}")
        return ServiceError(grpc.StatusCode.UNAVAILABLE, f"Tinker backend error: {error}")
    return None
