"""Request builders shared by the sync and async clients: validation happens here, before any network call."""

from __future__ import annotations

import uuid
from collections.abc import Mapping, Sequence
from typing import Any, Literal

from tinkerrpc import _convert as convert
from tinkerrpc._types import (
    CheckpointInfo,
    CheckpointKind,
    MessageLike,
    SupervisedExample,
    Tool,
    TrainOn,
    Trajectory,
    TrajectoryGroup,
    as_messages,
    check_trainable,
)
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

LossName = Literal["importance_sampling", "ppo", "cispo", "dro", "cross_entropy"]
Prompt = str | Sequence[int] | Sequence[MessageLike]
ToolLike = Tool | Mapping[str, Any]
GroupLike = TrajectoryGroup | Sequence[Trajectory]
ConversationLike = SupervisedExample | Sequence[MessageLike]


def _tools(tools: Sequence[ToolLike] | None) -> list[pb.Tool]:
    return [convert.tool_to_proto(t if isinstance(t, Tool) else Tool.from_openai(t)) for t in tools or ()]


def create_model_request(
    name: str,
    base_model: str,
    lora_rank: int,
    renderer: str | None,
    seed: int | None,
    train_mlp: bool,
    train_attn: bool,
    train_unembed: bool,
) -> service_pb.CreateModelRequest:
    if not name:
        raise ValueError("model name must not be empty")
    if not base_model:
        raise ValueError("base_model must not be empty")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}")
    return service_pb.CreateModelRequest(
        name=name,
        base_model=base_model,
        lora=pb.LoraConfig(
            rank=lora_rank, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
        ),
        renderer=renderer or "",
        seed=seed,
    )


def sample_request(
    model: str,
    prompt: Prompt,
    *,
    n: int,
    max_tokens: int,
    temperature: float,
    top_p: float | None,
    top_k: int,
    stop: Sequence[str],
    stop_token_ids: Sequence[int],
    seed: int | None,
    policy_version: int | None,
    tools: Sequence[ToolLike] | None,
    top_logprobs: int,
    include_prompt_logprobs: bool,
    return_token_texts: bool,
    ignore_default_stops: bool,
) -> service_pb.SampleRequest:
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if max_tokens < 1:
        raise ValueError(f"max_tokens must be >= 1, got {max_tokens}")
    if isinstance(stop, str):
        raise TypeError("stop must be a list of strings, not a single string")
    params = pb.SamplingParams(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stop,
        stop_token_ids=stop_token_ids,
        seed=seed,
        include_prompt_logprobs=include_prompt_logprobs,
        top_logprobs=top_logprobs,
        return_token_texts=return_token_texts,
        ignore_default_stops=ignore_default_stops,
    )
    request = service_pb.SampleRequest(model=model, policy_version=policy_version, params=params)
    if isinstance(prompt, str):
        if tools:
            raise ValueError("tools need a chat prompt (a list of messages), not text")
        request.text = prompt
    elif not prompt:
        raise ValueError("the prompt is empty: give messages, token ids or text")
    elif all(isinstance(t, int) for t in prompt):
        if tools:
            raise ValueError("tools need a chat prompt (a list of messages), not token ids")
        request.tokens.token_ids.extend(prompt)  # type: ignore[arg-type]
    else:
        messages = as_messages(prompt)  # type: ignore[arg-type]
        request.chat.messages.extend(convert.message_to_proto(m) for m in messages)
        request.chat.tools.extend(_tools(tools))
    return request


def _adam(
    learning_rate: float,
    beta1: float | None,
    beta2: float | None,
    eps: float | None,
    weight_decay: float,
    grad_clip_norm: float,
) -> pb.AdamParams:
    if not learning_rate > 0:
        raise ValueError(f"learning_rate must be > 0, got {learning_rate}")
    return pb.AdamParams(
        learning_rate=learning_rate,
        beta1=beta1,
        beta2=beta2,
        eps=eps,
        weight_decay=weight_decay,
        grad_clip_norm=grad_clip_norm,
    )


def train_request(
    model: str,
    groups: Sequence[GroupLike],
    *,
    loss: LossName,
    learning_rate: float,
    max_staleness: int | None,
    strict_staleness: bool,
    normalize_std: bool,
    clip_low_threshold: float | None,
    clip_high_threshold: float | None,
    beta: float | None,
    adam_beta1: float | None,
    adam_beta2: float | None,
    adam_eps: float | None,
    weight_decay: float,
    grad_clip_norm: float,
    expected_policy_version: int | None,
    idempotency_key: str | None,
) -> service_pb.TrainRequest:
    """An RL Train request; the idempotency key is fixed here, once per logical call, so retries reuse it."""
    if loss not in convert.LOSS_TO_PB:
        raise ValueError(f"loss must be one of {tuple(convert.LOSS_TO_PB)}, got {loss!r}")
    if loss == "cross_entropy":
        raise ValueError("cross_entropy trains on supervised examples: use train_supervised()")
    trajectory_groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup(list(g)) for g in groups]
    check_trainable(trajectory_groups)
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if strict_staleness and max_staleness is None:
        raise ValueError("strict_staleness needs max_staleness")
    return service_pb.TrainRequest(
        model=model,
        groups=[convert.group_to_proto(g) for g in trajectory_groups],
        loss=pb.LossConfig(
            function=convert.LOSS_TO_PB[loss],
            clip_low_threshold=clip_low_threshold,
            clip_high_threshold=clip_high_threshold,
            beta=beta,
        ),
        adam=_adam(learning_rate, adam_beta1, adam_beta2, adam_eps, weight_decay, grad_clip_norm),
        advantages=pb.AdvantageOptions(normalize_std=normalize_std),
        max_staleness=max_staleness,
        strict_staleness=strict_staleness,
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        expected_policy_version=expected_policy_version,
    )


def supervised_train_request(
    model: str,
    conversations: Sequence[ConversationLike],
    *,
    learning_rate: float,
    train_on: TrainOn,
    adam_beta1: float | None,
    adam_beta2: float | None,
    adam_eps: float | None,
    weight_decay: float,
    grad_clip_norm: float,
    expected_policy_version: int | None,
    idempotency_key: str | None,
) -> service_pb.TrainRequest:
    """A supervised (cross-entropy) Train request; plain conversations take `train_on`."""
    if not conversations:
        raise ValueError("train_supervised() needs at least one conversation")
    examples = [
        c if isinstance(c, SupervisedExample) else SupervisedExample(tuple(as_messages(c)), train_on=train_on)
        for c in conversations
    ]
    for i, example in enumerate(examples):
        if not any(m.role == "assistant" for m in example.messages):
            raise ValueError(f"conversations[{i}] has no assistant message to learn from")
    return service_pb.TrainRequest(
        model=model,
        examples=[convert.example_to_proto(e) for e in examples],
        loss=pb.LossConfig(function=pb.LOSS_FUNCTION_CROSS_ENTROPY),
        adam=_adam(learning_rate, adam_beta1, adam_beta2, adam_eps, weight_decay, grad_clip_norm),
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        expected_policy_version=expected_policy_version,
    )


def checkpoint_name(checkpoint: str | CheckpointInfo) -> str:
    name = checkpoint.name if isinstance(checkpoint, CheckpointInfo) else checkpoint
    if not name:
        raise ValueError("checkpoint name must not be empty")
    return name


def delete_checkpoint_request(
    model: str, checkpoint: str | CheckpointInfo, kind: CheckpointKind | None
) -> service_pb.DeleteCheckpointRequest:
    """A CheckpointInfo brings its own kind; a bare name defaults to a state checkpoint."""
    if kind is None:
        kind = checkpoint.kind if isinstance(checkpoint, CheckpointInfo) else "state"
    return service_pb.DeleteCheckpointRequest(
        model=model, checkpoint=checkpoint_name(checkpoint), kind=convert.kind_to_proto(kind)
    )
