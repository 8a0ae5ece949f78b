"""The conversions the SDK never makes: the server's direction (a dataclass as the response a server sends,
a request as the server reads it back), so that tests can round-trip every dataclass through protobuf."""

from __future__ import annotations

import json
from datetime import datetime

from google.protobuf import timestamp_pb2

from tinkerrpc import (
    CheckpointInfo,
    ModelInfo,
    Sample,
    SampledTurn,
    SupervisedExample,
    Tool,
    TrainMetrics,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
)
from tinkerrpc import _convert as convert
from tinkerrpc._types import StopReason, TrainOn
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

STOP_TO_PB: dict[StopReason | None, pb.StopReason.ValueType] = {
    None: pb.STOP_REASON_UNSPECIFIED,
    "stop": pb.STOP_REASON_STOP,
    "length": pb.STOP_REASON_LENGTH,
}
TRAIN_ON_FROM_PB: dict[pb.TrainOn.ValueType, TrainOn] = {
    pb.TRAIN_ON_UNSPECIFIED: "all",
    pb.TRAIN_ON_ALL_ASSISTANT_MESSAGES: "all",
    pb.TRAIN_ON_LAST_ASSISTANT_MESSAGE: "last",
}


def time_to_proto(value: datetime | None) -> timestamp_pb2.Timestamp | None:
    if value is None:
        return None
    stamp = timestamp_pb2.Timestamp()
    stamp.FromDatetime(value)
    return stamp


def tool_from_proto(msg: pb.Tool) -> Tool:
    return Tool(
        name=msg.name,
        description=msg.description,
        parameters=json.loads(msg.parameters_json) if msg.parameters_json else {},
    )


def turn_from_proto(msg: pb.SampledTurn) -> SampledTurn:
    return SampledTurn(
        prompt_token_ids=tuple(msg.prompt_token_ids),
        completion_token_ids=tuple(msg.completion_token_ids),
        logprobs=tuple(msg.completion_logprobs),
        policy_version=msg.policy_version,
    )


def trajectory_from_proto(msg: pb.Trajectory) -> Trajectory:
    return Trajectory(
        messages=[convert.message_from_proto(m) for m in msg.messages],
        turns=[turn_from_proto(t) for t in msg.turns],
        reward=msg.reward,
        metrics=dict(msg.metrics),
        metadata=dict(msg.metadata),
        tools=[tool_from_proto(t) for t in msg.tools],
    )


def group_from_proto(msg: pb.TrajectoryGroup) -> TrajectoryGroup:
    return TrajectoryGroup([trajectory_from_proto(t) for t in msg.trajectories])


def example_from_proto(msg: pb.SupervisedExample) -> SupervisedExample:
    return SupervisedExample(
        messages=tuple(convert.message_from_proto(m) for m in msg.messages),
        tools=tuple(tool_from_proto(t) for t in msg.tools),
        train_on=TRAIN_ON_FROM_PB[msg.train_on],
    )


def checkpoint_to_proto(info: CheckpointInfo) -> pb.CheckpointInfo:
    return pb.CheckpointInfo(
        model=info.model,
        name=info.name,
        policy_version=info.policy_version,
        kind=convert.kind_to_proto(info.kind),
        tinker_path=info.tinker_path,
        create_time=time_to_proto(info.create_time),
        automatic=info.automatic,
    )


def model_info_to_proto(info: ModelInfo) -> pb.ModelInfo:
    return pb.ModelInfo(
        name=info.name,
        base_model=info.base_model,
        lora=pb.LoraConfig(
            rank=info.lora_rank,
            train_mlp=info.train_mlp,
            train_attn=info.train_attn,
            train_unembed=info.train_unembed,
        ),
        renderer=info.renderer,
        policy_version=info.policy_version,
        sampleable_versions=info.sampleable_versions,
        create_time=time_to_proto(info.create_time),
        seed=info.seed,
        tinker_run_id=info.tinker_run_id,
        vocab_size=info.vocab_size,
        max_context_length=info.max_context_length,
    )


def metrics_to_proto(metrics: TrainMetrics) -> pb.TrainMetrics:
    return pb.TrainMetrics(
        loss=metrics.loss,
        mean_reward=metrics.mean_reward,
        trained_tokens=metrics.trained_tokens,
        total_tokens=metrics.total_tokens,
        trajectories_used=metrics.trajectories_used,
        dropped_stale=metrics.dropped_stale,
        dropped_zero_variance=metrics.dropped_zero_variance,
        zero_variance_groups=metrics.zero_variance_groups,
        staleness_histogram=metrics.staleness_histogram,
        step_seconds=metrics.step_seconds,
        tokens_per_second=metrics.tokens_per_second,
        extra=metrics.extra,
        std_reward=metrics.std_reward,
        learning_rate=metrics.learning_rate,
    )


def train_result_to_proto(result: TrainResult) -> service_pb.TrainResponse:
    return service_pb.TrainResponse(
        policy_version=result.policy_version,
        metrics=metrics_to_proto(result.metrics),
        sampler_checkpoint=checkpoint_to_proto(result.sampler_checkpoint)
        if result.sampler_checkpoint
        else None,
        state_checkpoint=checkpoint_to_proto(result.state_checkpoint) if result.state_checkpoint else None,
        replayed=result.replayed,
    )


def sample_to_proto(sample: Sample) -> pb.SampledSequence:
    """One Sample as the sequence a server returns (the prompt fields live on the response)."""
    return pb.SampledSequence(
        token_ids=sample.tokens,
        logprobs=sample.logprobs,
        text=sample.text,
        message=convert.message_to_proto(sample.message) if sample.message is not None else None,
        stop_reason=STOP_TO_PB[sample.stop_reason],
        policy_version=sample.policy_version,
        top_logprobs=[
            pb.TopLogprobs(
                token_ids=[c.token_id for c in position],
                logprobs=[c.logprob for c in position],
                token_texts=[c.text for c in position],
                token_bytes=[c.bytes for c in position if c.bytes is not None],
            )
            for position in sample.top_logprobs
        ],
        token_texts=sample.token_texts,
        token_bytes=sample.token_bytes,
    )
