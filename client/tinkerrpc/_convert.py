"""The one place where the SDK's dataclasses become protobuf messages and back."""

from __future__ import annotations

import json
from datetime import datetime, timezone

from google.protobuf import timestamp_pb2

from tinkerrpc._messages import Message, Role, Tool, ToolCall
from tinkerrpc._types import (
    CheckpointInfo,
    CheckpointKind,
    ModelEvent,
    ModelEventKind,
    ModelInfo,
    RunHistory,
    RunStep,
    Sample,
    SamplerMismatch,
    StopReason,
    SupervisedExample,
    TopLogprob,
    TrainMetrics,
    TrainOn,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)
from tinkerrpc.contract.estimators import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS
from tinkerrpc.contract.losses import LOSSES
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

_ROLE_TO_PB: dict[Role, pb.Role.ValueType] = {
    "system": pb.ROLE_SYSTEM,
    "user": pb.ROLE_USER,
    "assistant": pb.ROLE_ASSISTANT,
    "tool": pb.ROLE_TOOL,
}
_ROLE_FROM_PB = {v: k for k, v in _ROLE_TO_PB.items()}

_KIND_TO_PB: dict[CheckpointKind, pb.CheckpointKind.ValueType] = {
    "state": pb.CHECKPOINT_KIND_STATE,
    "sampler": pb.CHECKPOINT_KIND_SAMPLER,
}
_KIND_FROM_PB = {v: k for k, v in _KIND_TO_PB.items()}

_STOP_FROM_PB: dict[pb.StopReason.ValueType, StopReason | None] = {
    pb.STOP_REASON_UNSPECIFIED: None,
    pb.STOP_REASON_STOP: "stop",
    pb.STOP_REASON_LENGTH: "length",
}

_TRAIN_ON_TO_PB: dict[TrainOn, pb.TrainOn.ValueType] = {
    "all": pb.TRAIN_ON_ALL_ASSISTANT_MESSAGES,
    "last": pb.TRAIN_ON_LAST_ASSISTANT_MESSAGE,
}
# Each loss of the contract's table by its proto enum value (tinkerrpc.contract.losses).
LOSS_TO_PB: dict[str, pb.LossFunction.ValueType] = {
    loss.name: pb.LossFunction.Value(loss.proto_enum) for loss in LOSSES
}
# Each advantage estimator and loss aggregation of the contract's tables by its proto enum value.
ESTIMATOR_TO_PB: dict[str, pb.AdvantageEstimator.ValueType] = {
    e.name: pb.AdvantageEstimator.Value(e.proto_enum) for e in ADVANTAGE_ESTIMATORS
}
AGGREGATION_TO_PB: dict[str, pb.LossAggregation.ValueType] = {
    a.name: pb.LossAggregation.Value(a.proto_enum) for a in LOSS_AGGREGATIONS
}


def kind_to_proto(kind: CheckpointKind) -> pb.CheckpointKind.ValueType:
    if kind not in _KIND_TO_PB:
        raise ValueError(f"checkpoint kind must be one of {tuple(_KIND_TO_PB)}, got {kind!r}")
    return _KIND_TO_PB[kind]


def train_on_to_proto(train_on: TrainOn) -> pb.TrainOn.ValueType:
    if train_on not in _TRAIN_ON_TO_PB:
        raise ValueError(f"train_on must be one of {tuple(_TRAIN_ON_TO_PB)}, got {train_on!r}")
    return _TRAIN_ON_TO_PB[train_on]


# WatchModelResponse's `event` oneof -> ModelEvent.kind.
EVENT_KINDS: dict[str, ModelEventKind] = {
    "version": "version",
    "checkpoint_saved": "checkpoint_saved",
    "checkpoint_deleted": "checkpoint_deleted",
    "restored": "restored",
}


def _time_from_proto(msg: timestamp_pb2.Timestamp, present: bool) -> datetime | None:
    return msg.ToDatetime(tzinfo=timezone.utc) if present else None


def tool_call_to_proto(call: ToolCall) -> pb.ToolCall:
    return pb.ToolCall(id=call.id, name=call.name, arguments_json=call.arguments)


def tool_call_from_proto(msg: pb.ToolCall) -> ToolCall:
    return ToolCall(id=msg.id, name=msg.name, arguments=msg.arguments_json or "{}")


def tool_to_proto(tool: Tool) -> pb.Tool:
    return pb.Tool(
        name=tool.name, description=tool.description, parameters_json=json.dumps(dict(tool.parameters))
    )


def message_to_proto(message: Message) -> pb.Message:
    return pb.Message(
        role=_ROLE_TO_PB[message.role],
        content=message.content,
        tool_calls=[tool_call_to_proto(c) for c in message.tool_calls],
        tool_call_id=message.tool_call_id,
        name=message.name,
    )


def message_from_proto(msg: pb.Message) -> Message:
    if msg.role not in _ROLE_FROM_PB:
        raise ValueError(f"message has no valid role (got enum value {msg.role})")
    return Message(
        role=_ROLE_FROM_PB[msg.role],
        content=msg.content,
        tool_calls=tuple(tool_call_from_proto(c) for c in msg.tool_calls),
        tool_call_id=msg.tool_call_id,
        name=msg.name,
    )


# The trajectory writers fill `out` when given one (e.g. `request.groups.add()`): the token arrays are
# built in place instead of in a message that is then copied in, since Train requests carry the most bytes.


def trajectory_to_proto(traj: Trajectory, out: pb.Trajectory | None = None) -> pb.Trajectory:
    msg = pb.Trajectory() if out is None else out
    msg.messages.extend(message_to_proto(m) for m in traj.messages)
    for turn in traj.turns:
        msg.turns.add(
            prompt_token_ids=turn.prompt_token_ids,
            completion_token_ids=turn.completion_token_ids,
            completion_logprobs=turn.logprobs,
            policy_version=turn.policy_version,
            sample_key=turn.sample_key or None,
            advantages=turn.advantages,
        )
    msg.reward = traj.reward
    msg.metrics.update(traj.metrics)
    msg.metadata.update(traj.metadata)
    msg.tools.extend(tool_to_proto(t) for t in traj.tools)
    return msg


def group_to_proto(group: TrajectoryGroup, out: pb.TrajectoryGroup | None = None) -> pb.TrajectoryGroup:
    msg = pb.TrajectoryGroup() if out is None else out
    for traj in group.trajectories:
        trajectory_to_proto(traj, msg.trajectories.add())
    return msg


def example_to_proto(example: SupervisedExample) -> pb.SupervisedExample:
    return pb.SupervisedExample(
        messages=[message_to_proto(m) for m in example.messages],
        tools=[tool_to_proto(t) for t in example.tools],
        train_on=train_on_to_proto(example.train_on),
    )


def checkpoint_from_proto(msg: pb.CheckpointInfo) -> CheckpointInfo:
    if msg.kind not in _KIND_FROM_PB:
        raise ValueError(f"checkpoint {msg.name!r} has no valid kind (got enum value {msg.kind})")
    return CheckpointInfo(
        model=msg.model,
        name=msg.name,
        policy_version=msg.policy_version,
        kind=_KIND_FROM_PB[msg.kind],
        tinker_path=msg.tinker_path,
        create_time=_time_from_proto(msg.create_time, msg.HasField("create_time")),
        automatic=msg.automatic,
    )


def model_info_from_proto(msg: pb.ModelInfo) -> ModelInfo:
    lora = msg.lora
    # Unset LoRA flags mean the documented default (true).
    return ModelInfo(
        name=msg.name,
        base_model=msg.base_model,
        policy_version=msg.policy_version,
        lora_rank=lora.rank,
        train_mlp=lora.train_mlp if lora.HasField("train_mlp") else True,
        train_attn=lora.train_attn if lora.HasField("train_attn") else True,
        train_unembed=lora.train_unembed if lora.HasField("train_unembed") else True,
        renderer=msg.renderer,
        sampleable_versions=tuple(msg.sampleable_versions),
        create_time=_time_from_proto(msg.create_time, msg.HasField("create_time")),
        seed=msg.seed,
        tinker_run_id=msg.tinker_run_id,
        vocab_size=msg.vocab_size,
        max_context_length=msg.max_context_length,
    )


def _mismatch_from_proto(msg: pb.TrainMetrics) -> SamplerMismatch | None:
    if not msg.HasField("sampler_mismatch"):
        return None
    m = msg.sampler_mismatch
    return SamplerMismatch(
        kl=m.kl,
        mean_ratio=m.mean_ratio,
        max_ratio=m.max_ratio,
        outside_fraction=m.outside_fraction,
        tokens=m.tokens,
        capped_fraction=m.capped_fraction,
        ratio_cap=m.ratio_cap or None,
    )


def metrics_from_proto(msg: pb.TrainMetrics) -> TrainMetrics:
    return TrainMetrics(
        loss=msg.loss,
        mean_reward=msg.mean_reward,
        trained_tokens=msg.trained_tokens,
        total_tokens=msg.total_tokens,
        trajectories_used=msg.trajectories_used,
        dropped_stale=msg.dropped_stale,
        dropped_zero_variance=msg.dropped_zero_variance,
        zero_variance_groups=msg.zero_variance_groups,
        staleness_histogram=dict(msg.staleness_histogram),
        step_seconds=msg.step_seconds,
        tokens_per_second=msg.tokens_per_second,
        extra=dict(msg.extra),
        std_reward=msg.std_reward,
        learning_rate=msg.learning_rate,
        scored_tokens=msg.scored_tokens,
        sampler_mismatch=_mismatch_from_proto(msg),
        reference_kl=msg.reference_kl if msg.HasField("reference_kl") else None,
        teacher_kl=msg.teacher_kl if msg.HasField("teacher_kl") else None,
        minibatch_losses=tuple(msg.minibatch_losses),
    )


def run_step_from_proto(msg: pb.RunStep) -> RunStep:
    return RunStep(
        policy_version=msg.policy_version,
        metrics=metrics_from_proto(msg.metrics),
        commit_time=_time_from_proto(msg.commit_time, msg.HasField("commit_time")),
        checkpoints=tuple(checkpoint_from_proto(c) for c in msg.checkpoints),
    )


def run_history_from_proto(msg: service_pb.GetRunHistoryResponse) -> RunHistory:
    return RunHistory(
        steps=tuple(run_step_from_proto(s) for s in msg.steps), next_page_token=msg.next_page_token or None
    )


def model_event_from_proto(msg: service_pb.WatchModelResponse) -> ModelEvent:
    kind = msg.WhichOneof("event")
    if kind is None or kind not in EVENT_KINDS:
        raise ValueError(f"WatchModel sent an event this SDK does not know ({kind!r}): upgrade tinkerrpc")
    checkpoint = {
        "checkpoint_saved": msg.checkpoint_saved,
        "checkpoint_deleted": msg.checkpoint_deleted,
        "restored": msg.restored.checkpoint,
    }.get(kind)
    return ModelEvent(
        kind=EVENT_KINDS[kind],
        policy_version=msg.policy_version,
        time=_time_from_proto(msg.event_time, msg.HasField("event_time")),
        step=run_step_from_proto(msg.version) if kind == "version" else None,
        checkpoint=checkpoint_from_proto(checkpoint) if checkpoint is not None else None,
        replayed=msg.replayed,
    )


def train_result_from_proto(msg: service_pb.TrainResponse) -> TrainResult:
    return TrainResult(
        policy_version=msg.policy_version,
        metrics=metrics_from_proto(msg.metrics),
        sampler_checkpoint=(
            checkpoint_from_proto(msg.sampler_checkpoint) if msg.HasField("sampler_checkpoint") else None
        ),
        state_checkpoint=checkpoint_from_proto(msg.state_checkpoint)
        if msg.HasField("state_checkpoint")
        else None,
        replayed=msg.replayed,
    )


def top_logprobs_from_proto(top: pb.TopLogprobs) -> tuple[TopLogprob, ...]:
    """One sampled position's alternatives."""
    return tuple(
        TopLogprob(
            token_id,
            logprob,
            top.token_texts[i] if i < len(top.token_texts) else "",
            top.token_bytes[i] if i < len(top.token_bytes) else None,
        )
        for i, (token_id, logprob) in enumerate(zip(top.token_ids, top.logprobs, strict=False))
    )


def stop_reason_from_proto(reason: pb.StopReason.ValueType) -> StopReason | None:
    return _STOP_FROM_PB.get(reason)


def samples_from_proto(msg: service_pb.SampleResponse) -> list[Sample]:
    """Every sequence of a Sample response; the response's prompt ids and logprobs go on each."""
    prompt_ids = tuple(msg.prompt_token_ids)
    prompt_logprobs = tuple(msg.prompt_logprobs)
    prompt_top_logprobs = tuple(top_logprobs_from_proto(top) for top in msg.prompt_top_logprobs)
    return [
        Sample(
            tokens=tuple(seq.token_ids),
            logprobs=tuple(seq.logprobs),
            text=seq.text,
            message=message_from_proto(seq.message) if seq.HasField("message") else None,
            stop_reason=stop_reason_from_proto(seq.stop_reason),
            policy_version=seq.policy_version,
            prompt_token_ids=prompt_ids,
            top_logprobs=tuple(top_logprobs_from_proto(top) for top in seq.top_logprobs),
            token_texts=tuple(seq.token_texts),
            token_bytes=tuple(seq.token_bytes),
            prompt_logprobs=prompt_logprobs,
            prompt_top_logprobs=prompt_top_logprobs,
            prompt_text=msg.prompt_text,
            sample_key=seq.sample_key,
        )
        for seq in msg.sequences
    ]
