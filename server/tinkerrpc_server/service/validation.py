"""Request checks that run before anything touches the backend: every problem becomes a BadRequest
field violation naming the field (e.g. `groups[0].trajectories[1].turns[0].completion_logprobs`)."""

from __future__ import annotations

import math
import re

from tinker.types import LossFnType

from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.service.errors import Violations
from tinkerrpc_server.service.rendering import check_messages, check_tools

NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")
NAME_RULE = "1-64 characters of [A-Za-z0-9._-], starting with a letter or digit"

RL_LOSSES: dict[types_pb2.LossFunction.ValueType, LossFnType] = {
    types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING: "importance_sampling",
    types_pb2.LOSS_FUNCTION_PPO: "ppo",
    types_pb2.LOSS_FUNCTION_CISPO: "cispo",
    types_pb2.LOSS_FUNCTION_DRO: "dro",
}


def check_name(violations: Violations, field: str, name: str) -> None:
    if not NAME_PATTERN.fullmatch(name):
        violations.add(field, f"{name!r}: must be {NAME_RULE}")


def loss_name(request: trainer_service_pb2.TrainRequest) -> LossFnType:
    """The Tinker loss for a validated request (unset: cross-entropy for examples, IS for groups)."""
    function = request.loss.function
    if function == types_pb2.LOSS_FUNCTION_UNSPECIFIED:
        return "cross_entropy" if request.examples else "importance_sampling"
    if function == types_pb2.LOSS_FUNCTION_CROSS_ENTROPY:
        return "cross_entropy"
    return RL_LOSSES[function]


def _finite(value: float) -> bool:
    return math.isfinite(value)


def check_train_request(
    request: trainer_service_pb2.TrainRequest, current_version: int, vocab_size: int
) -> None:
    """Raises INVALID_ARGUMENT with every violation found; lengths against the context are checked
    when datums are built (still before anything runs)."""
    v = Violations()
    if request.groups and request.examples:
        v.add("groups", "give either groups (RL) or examples (supervised), not both")
    if not request.groups and not request.examples:
        v.add("groups", "empty batch: give trajectory groups (RL) or supervised examples")
    _check_loss(v, request)
    _check_adam(v, request.adam)
    if request.HasField("max_staleness") and request.max_staleness < 0:
        v.add("max_staleness", "must be >= 0")
    if request.strict_staleness and not request.HasField("max_staleness"):
        v.add("strict_staleness", "needs max_staleness")
    if request.HasField("expected_policy_version") and request.expected_policy_version < 0:
        v.add("expected_policy_version", "must be >= 0")
    for g, group in enumerate(request.groups):
        if not group.trajectories:
            v.add(f"groups[{g}].trajectories", "a group needs at least one trajectory")
        for t, trajectory in enumerate(group.trajectories):
            _check_trajectory(v, f"groups[{g}].trajectories[{t}]", trajectory, current_version, vocab_size)
    for e, example in enumerate(request.examples):
        field = f"examples[{e}]"
        for field_name, description in check_messages(list(example.messages), f"{field}.messages"):
            v.add(field_name, description)
        for field_name, description in check_tools(list(example.tools), f"{field}.tools"):
            v.add(field_name, description)
        if not any(m.role == types_pb2.ROLE_ASSISTANT for m in example.messages):
            v.add(f"{field}.messages", "a supervised example needs at least one assistant message")
        if example.train_on not in types_pb2.TrainOn.values():
            v.add(f"{field}.train_on", f"unknown value {example.train_on}")
    v.raise_if_any()


def _check_loss(v: Violations, request: trainer_service_pb2.TrainRequest) -> None:
    loss = request.loss
    if loss.function not in types_pb2.LossFunction.values():
        v.add("loss.function", f"unknown loss function {loss.function}")
        return
    if request.examples and loss.function not in (
        types_pb2.LOSS_FUNCTION_UNSPECIFIED,
        types_pb2.LOSS_FUNCTION_CROSS_ENTROPY,
    ):
        v.add("loss.function", "supervised examples train with cross-entropy only")
    if request.groups and loss.function == types_pb2.LOSS_FUNCTION_CROSS_ENTROPY:
        v.add(
            "loss.function",
            "trajectory groups need a policy-gradient loss (importance_sampling, ppo, cispo, dro)",
        )
    low = loss.clip_low_threshold if loss.HasField("clip_low_threshold") else 0.8
    high = loss.clip_high_threshold if loss.HasField("clip_high_threshold") else 1.2
    if not (_finite(low) and low > 0):
        v.add("loss.clip_low_threshold", "must be a finite number > 0")
    if not (_finite(high) and high >= 1.0):
        v.add("loss.clip_high_threshold", "must be a finite number >= 1")
    if _finite(low) and _finite(high) and low > 1.0:
        v.add("loss.clip_low_threshold", "must be <= 1")
    if loss.HasField("beta") and not (_finite(loss.beta) and loss.beta >= 0):
        v.add("loss.beta", "must be a finite number >= 0")


def _check_adam(v: Violations, adam: types_pb2.AdamParams) -> None:
    if not (_finite(adam.learning_rate) and adam.learning_rate > 0):
        v.add("adam.learning_rate", "must be a finite number > 0 (it is required)")
    for name in ("beta1", "beta2"):
        if adam.HasField(name):
            value = getattr(adam, name)
            if not (_finite(value) and 0 <= value < 1):
                v.add(f"adam.{name}", "must be in [0, 1)")
    if adam.HasField("eps") and not (_finite(adam.eps) and adam.eps >= 0):
        v.add("adam.eps", "must be a finite number >= 0")
    if not (_finite(adam.weight_decay) and adam.weight_decay >= 0):
        v.add("adam.weight_decay", "must be a finite number >= 0")
    if not (_finite(adam.grad_clip_norm) and adam.grad_clip_norm >= 0):
        v.add("adam.grad_clip_norm", "must be a finite number >= 0 (0 disables clipping)")


def _check_tokens(v: Violations, field: str, tokens: list[int], vocab_size: int) -> None:
    bad = next((i for i, token in enumerate(tokens) if not 0 <= token < vocab_size), None)
    if bad is not None:
        v.add(field, f"token id {tokens[bad]} at index {bad} is outside the vocabulary [0, {vocab_size})")


def _check_trajectory(
    v: Violations, field: str, trajectory: types_pb2.Trajectory, current_version: int, vocab_size: int
) -> None:
    if not _finite(trajectory.reward):
        v.add(f"{field}.reward", f"must be finite, got {trajectory.reward}")
    for name, value in trajectory.metrics.items():
        if not _finite(value):
            v.add(f"{field}.metrics[{name}]", "must be finite")
    for field_name, description in check_messages(list(trajectory.messages), f"{field}.messages"):
        v.add(field_name, description)
    for field_name, description in check_tools(list(trajectory.tools), f"{field}.tools"):
        v.add(field_name, description)
    if not trajectory.turns:
        v.add(f"{field}.turns", "no sampled turn: RL needs the token ids and logprobs the sampler returned")
    assistant_messages = sum(1 for m in trajectory.messages if m.role == types_pb2.ROLE_ASSISTANT)
    for k, turn in enumerate(trajectory.turns):
        turn_field = f"{field}.turns[{k}]"
        if not turn.completion_token_ids:
            v.add(
                f"{turn_field}.completion_token_ids", "empty: a sampled turn needs the completion token ids"
            )
        if len(turn.completion_logprobs) != len(turn.completion_token_ids):
            v.add(
                f"{turn_field}.completion_logprobs",
                f"{len(turn.completion_logprobs)} logprobs for {len(turn.completion_token_ids)} completion tokens",
            )
        elif not all(_finite(lp) for lp in turn.completion_logprobs):
            v.add(f"{turn_field}.completion_logprobs", "must be finite")
        _check_tokens(v, f"{turn_field}.completion_token_ids", list(turn.completion_token_ids), vocab_size)
        _check_tokens(v, f"{turn_field}.prompt_token_ids", list(turn.prompt_token_ids), vocab_size)
        if not turn.prompt_token_ids and k >= assistant_messages:
            v.add(
                f"{turn_field}.prompt_token_ids",
                "empty, and the trajectory has no matching assistant message to re-render the prompt from",
            )
        if not 0 <= turn.policy_version <= current_version:
            v.add(
                f"{turn_field}.policy_version",
                f"{turn.policy_version} is not a version of this model (current version {current_version})",
            )
