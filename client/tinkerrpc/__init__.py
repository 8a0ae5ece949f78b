"""tinkerrpc: the Python client SDK for the tinkerrpc TrainerService.

Plain dataclasses in, plain dataclasses out; protobuf stays inside. `Client` blocks,
`AsyncClient` awaits; both retry transient failures and make every Train exactly-once.

The public names below load on first use (PEP 562), so that importing a part that needs none of them
(`tinkerrpc.contract`, read by the CLI, the engine and the docs) does not import grpc and the whole SDK.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from tinkerrpc._async_client import AsyncClient, AsyncModel
    from tinkerrpc._client import Client, Model
    from tinkerrpc._errors import (
        AlreadyExistsError,
        FailedPreconditionError,
        InvalidArgumentError,
        NotFoundError,
        ResourceExhaustedError,
        RPCError,
        StalePolicyError,
        UnauthenticatedError,
        UnavailableError,
        raise_for_rpc_error,
    )
    from tinkerrpc._export import ExportProtocolError
    from tinkerrpc._gather import (
        GatherResult,
        RewardSummary,
        TooManyRolloutErrors,
        gather_groups,
        gather_trajectories,
    )
    from tinkerrpc._messages import Message, SampledTurn, Tool, ToolCall
    from tinkerrpc._openai import messages_from_response_input
    from tinkerrpc._retry import RetryPolicy
    from tinkerrpc._sample_stream import SampleChunk, SampleDelta
    from tinkerrpc._sampling import SamplingOptions
    from tinkerrpc._server_info import ServerInfo, ServerLimits
    from tinkerrpc._train_terms import Distillation, KLPenalty, PolicyRef
    from tinkerrpc._types import (
        CheckpointInfo,
        ExportedWeights,
        ModelEvent,
        ModelInfo,
        RunHistory,
        RunStep,
        Sample,
        SamplerMismatch,
        SupervisedExample,
        TopLogprob,
        TrainMetrics,
        TrainResult,
        Trajectory,
        TrajectoryGroup,
    )
    from tinkerrpc._watch import AsyncEventStream, EventStream
    from tinkerrpc.v1.errors_pb2 import ErrorReason

# The module each public name is defined in: the imports above, for the run time
# (tests/client/test_client_imports.py keeps the two and __all__ equal).
_DEFINED_IN = {
    "tinkerrpc._async_client": ("AsyncClient", "AsyncModel"),
    "tinkerrpc._client": ("Client", "Model"),
    "tinkerrpc._errors": (
        "AlreadyExistsError",
        "FailedPreconditionError",
        "InvalidArgumentError",
        "NotFoundError",
        "ResourceExhaustedError",
        "RPCError",
        "StalePolicyError",
        "UnauthenticatedError",
        "UnavailableError",
        "raise_for_rpc_error",
    ),
    "tinkerrpc._export": ("ExportProtocolError",),
    "tinkerrpc._gather": (
        "GatherResult",
        "RewardSummary",
        "TooManyRolloutErrors",
        "gather_groups",
        "gather_trajectories",
    ),
    "tinkerrpc._messages": ("Message", "SampledTurn", "Tool", "ToolCall"),
    "tinkerrpc._openai": ("messages_from_response_input",),
    "tinkerrpc._retry": ("RetryPolicy",),
    "tinkerrpc._sample_stream": ("SampleChunk", "SampleDelta"),
    "tinkerrpc._sampling": ("SamplingOptions",),
    "tinkerrpc._server_info": ("ServerInfo", "ServerLimits"),
    "tinkerrpc._train_terms": ("Distillation", "KLPenalty", "PolicyRef"),
    "tinkerrpc._types": (
        "CheckpointInfo",
        "ExportedWeights",
        "ModelEvent",
        "ModelInfo",
        "RunHistory",
        "RunStep",
        "Sample",
        "SamplerMismatch",
        "SupervisedExample",
        "TopLogprob",
        "TrainMetrics",
        "TrainResult",
        "Trajectory",
        "TrajectoryGroup",
    ),
    "tinkerrpc._watch": ("AsyncEventStream", "EventStream"),
    "tinkerrpc.v1.errors_pb2": ("ErrorReason",),
}
_MODULE_OF = {name: module for module, names in _DEFINED_IN.items() for name in names}


def __getattr__(name: str) -> Any:
    """A public name, imported from its module the first time it is asked for, then kept here."""
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


__all__ = [
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncEventStream",
    "AsyncModel",
    "CheckpointInfo",
    "Client",
    "Distillation",
    "ErrorReason",
    "EventStream",
    "ExportProtocolError",
    "ExportedWeights",
    "FailedPreconditionError",
    "GatherResult",
    "InvalidArgumentError",
    "KLPenalty",
    "Message",
    "Model",
    "ModelEvent",
    "ModelInfo",
    "NotFoundError",
    "PolicyRef",
    "RPCError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "RewardSummary",
    "RunHistory",
    "RunStep",
    "Sample",
    "SampleChunk",
    "SampleDelta",
    "SampledTurn",
    "SamplerMismatch",
    "SamplingOptions",
    "ServerInfo",
    "ServerLimits",
    "StalePolicyError",
    "SupervisedExample",
    "TooManyRolloutErrors",
    "Tool",
    "ToolCall",
    "TopLogprob",
    "TrainMetrics",
    "TrainResult",
    "Trajectory",
    "TrajectoryGroup",
    "UnauthenticatedError",
    "UnavailableError",
    "gather_groups",
    "gather_trajectories",
    "messages_from_response_input",
    "raise_for_rpc_error",
]
