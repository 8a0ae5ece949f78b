"""Every RPC of the SDK as a prepared call, written once for the sync and the async client.

A function here takes the public method's exact arguments (it is the method's signature and docstring),
validates them, so bad input raises before any network call, and returns a `Call`: the request plus how
to send it and read the answer. _methods.py makes each one a method of the clients or the model handles.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path

from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2

from tinkerrpc import _convert as convert
from tinkerrpc._call_kinds import Call, StreamCall, WatchCall
from tinkerrpc._channel import remaining
from tinkerrpc._export import WeightsWriter, check_export_target
from tinkerrpc._messages import MessageLike, as_messages
from tinkerrpc._sampling import Prompt, SamplingOptions, ToolLike
from tinkerrpc._server_info import ServerInfo, server_info_from_proto
from tinkerrpc._train_terms import Distillation, KLPenalty, check_importance_ratio_cap
from tinkerrpc._types import (
    CheckpointInfo,
    CheckpointKind,
    ExportedWeights,
    ModelEvent,
    ModelInfo,
    RunHistory,
    Sample,
    SupervisedExample,
    TrainOn,
    TrainResult,
    Trajectory,
    TrajectoryGroup,
    check_trainable,
)
from tinkerrpc.contract.estimators import AdvantageEstimatorName, LossAggregationName
from tinkerrpc.contract.limits import DEFAULT_LEARNING_RATE, DEFAULT_LORA_RANK, MAX_HISTORY_PAGE_SIZE
from tinkerrpc.contract.losses import DEFAULT_RL_LOSS, LOSS_BY_NAME, LossName
from tinkerrpc.contract.sampling import DEFAULT_MAX_TOKENS
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

GroupLike = TrajectoryGroup | Sequence[Trajectory]
ConversationLike = SupervisedExample | Sequence[MessageLike]


def create_model(
    name: str,
    base_model: str,
    *,
    lora_rank: int = DEFAULT_LORA_RANK,
    renderer: str | None = None,
    seed: int | None = None,
    train_mlp: bool = True,
    train_attn: bool = True,
    train_unembed: bool = True,
    exist_ok: bool = False,
    timeout: float | None = None,
) -> Call[str]:
    """Create a model (a fresh LoRA run at policy version 0) and return its handle.

    With `exist_ok=True` an existing model of that name is returned as it is (at its current version)
    when its base model, LoRA shape (rank, train_mlp/attn/unembed) and renderer match; one that differs
    raises AlreadyExistsError naming each difference. The seed is not compared."""
    if not name:
        raise ValueError("model name must not be empty")
    if not base_model:
        raise ValueError("base_model must not be empty")
    if lora_rank < 1:
        raise ValueError(f"lora_rank must be >= 1, got {lora_rank}")
    request = service_pb.CreateModelRequest(
        name=name,
        base_model=base_model,
        lora=pb.LoraConfig(
            rank=lora_rank, train_mlp=train_mlp, train_attn=train_attn, train_unembed=train_unembed
        ),
        renderer=renderer or "",
        seed=seed,
        exist_ok=exist_ok,
    )
    # The result is the model's name, which the client turns into its handle.
    # Without exist_ok not safe to repeat on a deadline: a second attempt could hit ALREADY_EXISTS for
    # our own model. With it a repeat returns the model the first attempt made.
    return Call("CreateModel", request, lambda response: name, safe_to_repeat=exist_ok, timeout=timeout)


def server_info(target: str, *, timeout: float | None = None) -> Call[ServerInfo]:
    """The server's version, backend, hosted sidecar URL and request limits."""
    return Call(
        "GetServerInfo",
        service_pb.GetServerInfoRequest(),
        lambda response: server_info_from_proto(response, target),
        safe_to_repeat=True,
        timeout=timeout,
    )


def health_check(
    service: str, *, deadline: float, wait_for_ready: bool
) -> Call[health_pb2.HealthCheckResponse]:
    """One gRPC health check of `service` ("" for the server as a whole), answered by `deadline` (a
    time.monotonic() value)."""
    return Call(
        "Check",
        health_pb2.HealthCheckRequest(service=service),
        lambda response: response,
        safe_to_repeat=False,
        timeout=remaining(deadline),
        service="health",
        wait_for_ready=wait_for_ready,
    )


def get_model(name: str, *, timeout: float | None = None) -> Call[ModelInfo]:
    """The model's current state: policy version, sampleable versions, LoRA settings."""
    request = service_pb.GetModelRequest(name=name)
    return Call("GetModel", request, _model_info, safe_to_repeat=True, timeout=timeout)


def list_models(*, timeout: float | None = None) -> Call[list[ModelInfo]]:
    """Every model on the server."""
    return Call(
        "ListModels",
        service_pb.ListModelsRequest(),
        lambda response: [convert.model_info_from_proto(m) for m in response.models],
        safe_to_repeat=True,
        timeout=timeout,
    )


def delete_model(name: str, *, timeout: float | None = None) -> Call[None]:
    """Delete a model with its checkpoints."""
    request = service_pb.DeleteModelRequest(name=name)
    return Call("DeleteModel", request, _nothing, safe_to_repeat=False, timeout=timeout)


def sample(
    model: str,
    prompt: Prompt,
    *,
    n: int = 1,
    max_tokens: int = DEFAULT_MAX_TOKENS,
    temperature: float = 1.0,
    top_p: float | None = None,
    top_k: int = 0,
    stop: Sequence[str] = (),
    stop_token_ids: Sequence[int] = (),
    seed: int | None = None,
    policy_version: int | None = None,
    tools: Sequence[ToolLike] | None = None,
    top_logprobs: int = 0,
    include_prompt_logprobs: bool = False,
    prompt_top_logprobs: int = 0,
    return_token_texts: bool = False,
    ignore_default_stops: bool = False,
    min_tokens: int = 0,
    skip_special_tokens: bool = True,
    spaces_between_special_tokens: bool = True,
    return_prompt_text: bool = False,
    enable_thinking: bool | None = None,
    force_tool_call: bool | str = False,
    parallel_tool_calls: bool = True,
    options: SamplingOptions | None = None,
    timeout: float | None = None,
) -> Call[list[Sample]]:
    """Sample `n` completions of a chat prompt (messages), token ids or raw text.

    `top_logprobs` / `prompt_top_logprobs`: the k most likely tokens at each sampled / prompt position.
    `min_tokens`: no stop before that many tokens. `skip_special_tokens` / `spaces_between_special_tokens`:
    how `text` is decoded. `return_prompt_text`: `Sample.prompt_text` holds the prompt as text. Chat
    prompts only: `enable_thinking` renders with the renderer's thinking (True) or thinking-disabled
    (False) variant; `force_tool_call` (True: any of `tools`, or a function's name) makes the reply a
    tool call, its opening appended to the prompt as prompt tokens; `parallel_tool_calls=False` keeps
    the first call of each reply. `options`: all of these as one `SamplingOptions`, instead of them."""
    keywords = SamplingOptions(
        n=n,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        stop=stop,
        stop_token_ids=stop_token_ids,
        seed=seed,
        policy_version=policy_version,
        tools=tools,
        top_logprobs=top_logprobs,
        include_prompt_logprobs=include_prompt_logprobs,
        prompt_top_logprobs=prompt_top_logprobs,
        return_token_texts=return_token_texts,
        ignore_default_stops=ignore_default_stops,
        min_tokens=min_tokens,
        skip_special_tokens=skip_special_tokens,
        spaces_between_special_tokens=spaces_between_special_tokens,
        return_prompt_text=return_prompt_text,
        enable_thinking=enable_thinking,
        force_tool_call=force_tool_call,
        parallel_tool_calls=parallel_tool_calls,
    )
    if options is not None and keywords != SamplingOptions():
        raise TypeError(
            "give the sampling options either as options=SamplingOptions(...) or as keywords, not both"
        )
    request = (options or keywords).request(model, prompt)
    return Call("Sample", request, convert.samples_from_proto, safe_to_repeat=True, timeout=timeout)


def train(
    model: str,
    groups: Sequence[GroupLike],
    *,
    loss: LossName = DEFAULT_RL_LOSS,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    max_staleness: int | None = None,
    strict_staleness: bool = False,
    normalize_std: bool = False,
    advantage_estimator: AdvantageEstimatorName | None = None,
    loss_aggregation: LossAggregationName | None = None,
    clip_low_threshold: float | None = None,
    clip_high_threshold: float | None = None,
    beta: float | None = None,
    kl_penalty: KLPenalty | None = None,
    distillation: Distillation | None = None,
    importance_ratio_cap: float | None = None,
    adam_beta1: float | None = None,
    adam_beta2: float | None = None,
    adam_eps: float | None = None,
    weight_decay: float = 0.0,
    grad_clip_norm: float = 0.0,
    expected_policy_version: int | None = None,
    idempotency_key: str | None = None,
    timeout: float | None = None,
) -> Call[TrainResult]:
    """One RL optimizer step from trajectory groups; exactly once even when retried.

    `advantage_estimator` and `loss_aggregation` are rows of the contract's tables
    (tinkerrpc.contract.estimators); None: the server's defaults (token_sum; group_mean_std with
    normalize_std, group_mean without). `kl_penalty`, `distillation` and `importance_ratio_cap` are rows
    of tinkerrpc.contract.train_terms."""
    check_importance_ratio_cap(importance_ratio_cap)
    if advantage_estimator is not None and advantage_estimator not in convert.ESTIMATOR_TO_PB:
        raise ValueError(
            f"advantage_estimator must be one of {tuple(convert.ESTIMATOR_TO_PB)}, got {advantage_estimator!r}"
        )
    if loss_aggregation is not None and loss_aggregation not in convert.AGGREGATION_TO_PB:
        raise ValueError(
            f"loss_aggregation must be one of {tuple(convert.AGGREGATION_TO_PB)}, got {loss_aggregation!r}"
        )
    if loss not in LOSS_BY_NAME:
        raise ValueError(f"loss must be one of {tuple(LOSS_BY_NAME)}, got {loss!r}")
    if not LOSS_BY_NAME[loss].rl:
        raise ValueError(f"{loss} trains on supervised examples: use train_supervised()")
    trajectory_groups = [g if isinstance(g, TrajectoryGroup) else TrajectoryGroup(list(g)) for g in groups]
    check_trainable(trajectory_groups)
    if max_staleness is not None and max_staleness < 0:
        raise ValueError(f"max_staleness must be >= 0, got {max_staleness}")
    if strict_staleness and max_staleness is None:
        raise ValueError("strict_staleness needs max_staleness")
    request = service_pb.TrainRequest(
        model=model,
        loss=pb.LossConfig(
            function=convert.LOSS_TO_PB[loss],
            clip_low_threshold=clip_low_threshold,
            clip_high_threshold=clip_high_threshold,
            beta=beta,
            aggregation=convert.AGGREGATION_TO_PB[loss_aggregation]
            if loss_aggregation
            else pb.LOSS_AGGREGATION_UNSPECIFIED,
        ),
        adam=_adam(learning_rate, adam_beta1, adam_beta2, adam_eps, weight_decay, grad_clip_norm),
        advantages=pb.AdvantageOptions(
            normalize_std=normalize_std,
            estimator=convert.ESTIMATOR_TO_PB[advantage_estimator]
            if advantage_estimator
            else pb.ADVANTAGE_ESTIMATOR_UNSPECIFIED,
        ),
        max_staleness=max_staleness,
        strict_staleness=strict_staleness,
        # Fixed here, once per logical call, so that retries reuse it.
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        expected_policy_version=expected_policy_version,
        kl_penalty=kl_penalty.to_proto() if kl_penalty else None,
        distillation=distillation.to_proto() if distillation else None,
        importance_ratio_cap=importance_ratio_cap,
    )
    for group in trajectory_groups:
        convert.group_to_proto(group, request.groups.add())
    return Call("Train", request, convert.train_result_from_proto, safe_to_repeat=True, timeout=timeout)


def train_supervised(
    model: str,
    conversations: Sequence[ConversationLike],
    *,
    learning_rate: float = DEFAULT_LEARNING_RATE,
    train_on: TrainOn = "all",
    adam_beta1: float | None = None,
    adam_beta2: float | None = None,
    adam_eps: float | None = None,
    weight_decay: float = 0.0,
    grad_clip_norm: float = 0.0,
    expected_policy_version: int | None = None,
    idempotency_key: str | None = None,
    timeout: float | None = None,
    minibatch_size: int | None = None,
    minibatch_learning_rates: Sequence[float] = (),
) -> Call[TrainResult]:
    """One supervised (cross-entropy) Train on conversations, committing one policy version; exactly once
    even when retried.

    Plain conversations (lists of messages) take `train_on`; a SupervisedExample brings its own. One
    optimizer step, or with `minibatch_size` one per that many conversations in order (the last fewer),
    each at its learning rate in `minibatch_learning_rates` when given (one per minibatch), else at
    `learning_rate`; `TrainMetrics.minibatch_losses` reports each."""
    if not conversations:
        raise ValueError("train_supervised() needs at least one conversation")
    examples = [
        c if isinstance(c, SupervisedExample) else SupervisedExample(tuple(as_messages(c)), train_on=train_on)
        for c in conversations
    ]
    for i, example in enumerate(examples):
        if not any(m.role == "assistant" for m in example.messages):
            raise ValueError(f"conversations[{i}] has no assistant message to learn from")
    request = service_pb.TrainRequest(
        model=model,
        examples=[convert.example_to_proto(e) for e in examples],
        loss=pb.LossConfig(function=pb.LOSS_FUNCTION_CROSS_ENTROPY),
        adam=_adam(learning_rate, adam_beta1, adam_beta2, adam_eps, weight_decay, grad_clip_norm),
        idempotency_key=idempotency_key or str(uuid.uuid4()),
        expected_policy_version=expected_policy_version,
        minibatch_size=minibatch_size,
        minibatch_learning_rates=minibatch_learning_rates,
    )
    return Call("Train", request, convert.train_result_from_proto, safe_to_repeat=True, timeout=timeout)


def save_checkpoint(
    model: str, name: str | None = None, *, timeout: float | None = None
) -> Call[CheckpointInfo]:
    """Save the full training state; the server names it `step_<version>` when `name` is None."""
    request = service_pb.SaveCheckpointRequest(model=model, name=name or "")
    return Call("SaveCheckpoint", request, _checkpoint_info, safe_to_repeat=False, timeout=timeout)


def checkpoints(model: str, *, timeout: float | None = None) -> Call[list[CheckpointInfo]]:
    """Every checkpoint of the model (state and sampler), oldest first."""
    return Call(
        "ListCheckpoints",
        service_pb.ListCheckpointsRequest(model=model),
        lambda response: [convert.checkpoint_from_proto(c) for c in response.checkpoints],
        safe_to_repeat=True,
        timeout=timeout,
    )


def restore(model: str, checkpoint: str | CheckpointInfo, *, timeout: float | None = None) -> Call[ModelInfo]:
    """Move the model to a saved state checkpoint; returns the model at the checkpoint's version."""
    request = service_pb.RestoreCheckpointRequest(model=model, checkpoint=_checkpoint_name(checkpoint))
    # Restoring twice to the same checkpoint ends in the same state, so a deadline retry is safe.
    return Call("RestoreCheckpoint", request, _model_info, safe_to_repeat=True, timeout=timeout)


def delete_checkpoint(
    model: str,
    checkpoint: str | CheckpointInfo,
    kind: CheckpointKind | None = None,
    *,
    timeout: float | None = None,
) -> Call[None]:
    """Delete a checkpoint; a bare name means a state checkpoint unless `kind="sampler"`."""
    if kind is None:
        kind = checkpoint.kind if isinstance(checkpoint, CheckpointInfo) else "state"
    request = service_pb.DeleteCheckpointRequest(
        model=model, checkpoint=_checkpoint_name(checkpoint), kind=convert.kind_to_proto(kind)
    )
    return Call("DeleteCheckpoint", request, _nothing, safe_to_repeat=False, timeout=timeout)


def export_weights(
    model: str,
    directory: str | os.PathLike[str],
    *,
    policy_version: int | None = None,
    expected_policy_version: int | None = None,
    progress: bool = False,
    timeout: float | None = None,
) -> StreamCall[ExportedWeights]:
    """Download the model's LoRA adapter into `directory` (created; it must not exist or be empty), a
    plain PEFT adapter directory for vLLM, PeftModel.from_pretrained and the like. The directory appears
    only once every file arrived whole. `policy_version` picks an earlier version (exported from its
    state checkpoint; the model does not move); None means the current one. With
    `expected_policy_version`, fail (FailedPreconditionError) unless the model is at exactly that version.
    `progress` draws a progress bar (MiB received) on stderr."""
    target = Path(directory)
    check_export_target(target)
    for label, value in (
        ("policy_version", policy_version),
        ("expected_policy_version", expected_policy_version),
    ):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    request = service_pb.ExportWeightsRequest(
        model=model, policy_version=policy_version, expected_policy_version=expected_policy_version
    )
    return StreamCall("ExportWeights", request, lambda: WeightsWriter(target, progress), timeout=timeout)


def history(
    model: str,
    *,
    from_version: int | None = None,
    to_version: int | None = None,
    page_size: int = 0,
    page_token: str | None = None,
    timeout: float | None = None,
) -> Call[RunHistory]:
    """One page of the model's run: a RunStep (metrics, commit time, checkpoints) per policy version from
    `from_version` to `to_version` (inclusive; None: from the start, up to the current one), ascending.
    `page_size` steps at most (0: the server's DEFAULT_HISTORY_PAGE_SIZE; at most MAX_HISTORY_PAGE_SIZE,
    both in tinkerrpc.contract.limits); pass the returned `next_page_token` as `page_token`, with the same
    other arguments, for the next page."""
    for label, value in (("from_version", from_version), ("to_version", to_version)):
        if value is not None and value < 0:
            raise ValueError(f"{label} must be >= 0, got {value}")
    if from_version is not None and to_version is not None and to_version < from_version:
        raise ValueError(f"to_version ({to_version}) must be >= from_version ({from_version})")
    if not 0 <= page_size <= MAX_HISTORY_PAGE_SIZE:
        raise ValueError(f"page_size must be in [0, {MAX_HISTORY_PAGE_SIZE}], got {page_size}")
    request = service_pb.GetRunHistoryRequest(
        model=model,
        from_version=from_version,
        to_version=to_version,
        page_size=page_size,
        page_token=page_token or "",
    )
    return Call(
        "GetRunHistory", request, convert.run_history_from_proto, safe_to_repeat=True, timeout=timeout
    )


def watch(
    model: str, *, from_version: int | None = None, timeout: float | None = None
) -> WatchCall[ModelEvent]:
    """The model's events as they happen: new versions with their metrics, checkpoints saved and deleted,
    restores. With `from_version`, the history's versions from it on come first (`replayed=True`), then
    live events, none missed or repeated; to resume after losing the stream, watch again with
    from_version = the last version seen + 1. It lasts until closed, or `timeout` seconds (None: no
    deadline); NotFoundError when the model is deleted."""
    if from_version is not None and from_version < 0:
        raise ValueError(f"from_version must be >= 0, got {from_version}")
    request = service_pb.WatchModelRequest(model=model, from_version=from_version)
    return WatchCall("WatchModel", request, convert.model_event_from_proto, timeout=timeout)


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


def _checkpoint_name(checkpoint: str | CheckpointInfo) -> str:
    name = checkpoint.name if isinstance(checkpoint, CheckpointInfo) else checkpoint
    if not name:
        raise ValueError("checkpoint name must not be empty")
    return name


def _nothing(response: ProtoMessage) -> None:
    return None


def _model_info(response: service_pb.GetModelResponse | service_pb.RestoreCheckpointResponse) -> ModelInfo:
    return convert.model_info_from_proto(response.model)


def _checkpoint_info(response: service_pb.SaveCheckpointResponse) -> CheckpointInfo:
    return convert.checkpoint_from_proto(response.checkpoint)
