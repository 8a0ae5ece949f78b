"""tinkerrpc: the Python client SDK for the tinkerrpc TrainerService.

Plain dataclasses in, plain dataclasses out; protobuf stays inside. `Client` blocks,
`AsyncClient` awaits; both retry transient failures and make every Train exactly-once.
"""

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
from tinkerrpc._server_info import ServerInfo, ServerLimits
from tinkerrpc._types import (
    CheckpointInfo,
    ExportedWeights,
    ModelEvent,
    ModelInfo,
    RunHistory,
    RunStep,
    Sample,
    SupervisedExample,
    TopLogprob,
    TrainMetrics,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)
from tinkerrpc._watch import AsyncEventStream, EventStream
from tinkerrpc.v1.errors_pb2 import ErrorReason

__all__ = [
    "AlreadyExistsError",
    "AsyncClient",
    "AsyncEventStream",
    "AsyncModel",
    "CheckpointInfo",
    "Client",
    "ErrorReason",
    "EventStream",
    "ExportProtocolError",
    "ExportedWeights",
    "FailedPreconditionError",
    "GatherResult",
    "InvalidArgumentError",
    "Message",
    "Model",
    "ModelEvent",
    "ModelInfo",
    "NotFoundError",
    "RPCError",
    "ResourceExhaustedError",
    "RetryPolicy",
    "RewardSummary",
    "RunHistory",
    "RunStep",
    "Sample",
    "SampledTurn",
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
