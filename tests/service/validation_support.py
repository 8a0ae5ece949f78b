"""Shared by the in-process validation tests (test_validation.py, test_validation_sample.py): the
request context they check against and the violations a refused check reports."""

from __future__ import annotations

from collections.abc import Callable
from typing import cast

import grpc
import pytest
from google.rpc import error_details_pb2  # type: ignore[import-untyped]

from tinkerrpc.contract.limits import MAX_JSON_NUMBER_CHARS
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import validation
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.limits import Limits

VOCAB = 100
CONTEXT = 64
LIMITS = Limits(max_sample_n=8, max_sample_tokens=32, max_train_trajectories=2, max_train_tokens=50)
# Over the context's text bound (validation.MAX_TEXT_BYTES_PER_TOKEN bytes per token).
TOO_MUCH_TEXT = "x" * (CONTEXT * validation.MAX_TEXT_BYTES_PER_TOKEN + 1)
# Tool JSON past the JSON number bound, well within the context's text bound.
LONG_INTEGER_JSON = '{"a": 1' + "0" * MAX_JSON_NUMBER_CHARS + "}"
UNKNOWN_ROLE = cast(types_pb2.Role.ValueType, 99)


def violated(check: Callable[[], object]) -> list[str]:
    """The fields `check()` names in the INVALID_ARGUMENT it raises."""
    with pytest.raises(ServiceError) as err:
        check()
    assert err.value.code == grpc.StatusCode.INVALID_ARGUMENT, err.value.message
    (bad,) = [d for d in err.value.details if isinstance(d, error_details_pb2.BadRequest)]
    return [v.field for v in bad.field_violations]


def message(role: types_pb2.Role.ValueType, content: str = "hi") -> types_pb2.Message:
    return types_pb2.Message(role=role, content=content)
