"""Train requests → Tinker Datums: staleness, group advantages, token-exact RL datums per sampled turn,
and supervised datums from the renderer's weights. Pure CPU work that runs before the backend is touched,
off the event loop (build_batch)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import tinker
from tinker_cookbook.renderers import TrainOnWhat

from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.service.errors import STALE_POLICY_VERSION, Violations, failed_precondition
from tinkerrpc_server.service.rendering import ChatCodec, off_loop

STD_EPSILON = 1e-6


@dataclass
class Batch:
    datums: list[tinker.types.Datum] = field(default_factory=list)
    trained_tokens: int = 0
    total_tokens: int = 0
    used: int = 0
    dropped_stale: int = 0
    dropped_zero_variance: int = 0
    zero_variance_groups: int = 0
    staleness_histogram: dict[int, int] = field(default_factory=dict)
    mean_reward: float = 0.0
    std_reward: float = 0.0
    env_metrics: dict[str, float] = field(default_factory=dict)


def group_advantages(rewards: list[float], normalize_std: bool) -> list[float] | None:
    """reward − group mean, optionally over (population std + 1e-6); None for a zero-variance group."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if all(abs(c) == 0.0 for c in centred):
        return None
    if normalize_std:
        std = math.sqrt(sum(c * c for c in centred) / len(centred))
        return [c / (std + STD_EPSILON) for c in centred]
    return centred


def _staleness(trajectory: types_pb2.Trajectory, current_version: int) -> int:
    return current_version - min(turn.policy_version for turn in trajectory.turns)


def _turn_prompt(trajectory: types_pb2.Trajectory, turn_index: int, codec: ChatCodec) -> list[int]:
    """The turn's prompt ids, or (only when it carries none) the conversation before its assistant message,
    re-rendered with the model's renderer."""
    turn = trajectory.turns[turn_index]
    if turn.prompt_token_ids:
        return list(turn.prompt_token_ids)
    assistant_positions = [i for i, m in enumerate(trajectory.messages) if m.role == types_pb2.ROLE_ASSISTANT]
    history = list(trajectory.messages[: assistant_positions[turn_index]])
    return codec.generation_prompt(history, list(trajectory.tools))


def _rl_datum(prompt: list[int], turn: types_pb2.SampledTurn, advantage: float) -> tinker.types.Datum:
    completion = list(turn.completion_token_ids)
    tokens = prompt + completion
    prompt_positions = len(prompt) - 1
    return tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": tinker.types.TensorData(data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]),
            "logprobs": tinker.types.TensorData(
                data=[0.0] * prompt_positions + list(turn.completion_logprobs),
                dtype="float32",
                shape=[len(tokens) - 1],
            ),
            "advantages": tinker.types.TensorData(
                data=[0.0] * prompt_positions + [advantage] * len(completion),
                dtype="float32",
                shape=[len(tokens) - 1],
            ),
        },
    )


def rl_batch(request: trainer_service_pb2.TrainRequest, current_version: int, codec: ChatCodec) -> Batch:
    batch = Batch()
    rewards = [t.reward for g in request.groups for t in g.trajectories]
    batch.mean_reward = sum(rewards) / len(rewards)
    batch.std_reward = math.sqrt(sum((r - batch.mean_reward) ** 2 for r in rewards) / len(rewards))
    metric_sums: defaultdict[str, float] = defaultdict(float)
    metric_counts: Counter[str] = Counter()
    for group in request.groups:
        for trajectory in group.trajectories:
            staleness = _staleness(trajectory, current_version)
            batch.staleness_histogram[staleness] = batch.staleness_histogram.get(staleness, 0) + 1
            for name, value in trajectory.metrics.items():
                metric_sums[name] += value
                metric_counts[name] += 1
    batch.env_metrics = {f"env/{name}": metric_sums[name] / metric_counts[name] for name in metric_sums}

    violations = Violations()
    for g, group in enumerate(request.groups):
        fresh = []
        for t, trajectory in enumerate(group.trajectories):
            staleness = _staleness(trajectory, current_version)
            if request.HasField("max_staleness") and staleness > request.max_staleness:
                if request.strict_staleness:
                    raise failed_precondition(
                        STALE_POLICY_VERSION,
                        f"groups[{g}].trajectories[{t}] was sampled at version {current_version - staleness}, "
                        f"{staleness} versions behind the current {current_version} (max_staleness "
                        f"{request.max_staleness})",
                        {"current_version": current_version, "sampled_version": current_version - staleness},
                    )
                batch.dropped_stale += 1
                continue
            fresh.append((t, trajectory))
        if not fresh:
            continue
        advantages = group_advantages([tr.reward for _, tr in fresh], request.advantages.normalize_std)
        if advantages is None:
            batch.zero_variance_groups += 1
            batch.dropped_zero_variance += len(fresh)
            continue
        for (t, trajectory), advantage in zip(fresh, advantages, strict=True):
            for k, turn in enumerate(trajectory.turns):
                prompt = _turn_prompt(trajectory, k, codec)
                length = len(prompt) + len(turn.completion_token_ids)
                if length > codec.max_context_length:
                    violations.add(
                        f"groups[{g}].trajectories[{t}].turns[{k}]",
                        f"{length} tokens exceed the model's context of {codec.max_context_length}",
                    )
                    continue
                batch.datums.append(_rl_datum(prompt, turn, advantage))
                batch.trained_tokens += len(turn.completion_token_ids)
                batch.total_tokens += length
            batch.used += 1
    violations.raise_if_any()
    return batch


_TRAIN_ON = {
    types_pb2.TRAIN_ON_UNSPECIFIED: TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    types_pb2.TRAIN_ON_ALL_ASSISTANT_MESSAGES: TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    types_pb2.TRAIN_ON_LAST_ASSISTANT_MESSAGE: TrainOnWhat.LAST_ASSISTANT_MESSAGE,
}


def sft_batch(request: trainer_service_pb2.TrainRequest, codec: ChatCodec) -> Batch:
    batch = Batch()
    violations = Violations()
    for e, example in enumerate(request.examples):
        for tokens, weights in codec.supervised_examples(
            list(example.messages), list(example.tools), _TRAIN_ON[example.train_on]
        ):
            if len(tokens) > codec.max_context_length:
                violations.add(
                    f"examples[{e}]",
                    f"{len(tokens)} tokens exceed the model's context of {codec.max_context_length}",
                )
                continue
            target_weights = weights[1:]
            batch.datums.append(
                tinker.types.Datum(
                    model_input=tinker.types.ModelInput.from_ints(tokens[:-1]),
                    loss_fn_inputs={
                        "target_tokens": tinker.types.TensorData(
                            data=tokens[1:], dtype="int64", shape=[len(tokens) - 1]
                        ),
                        "weights": tinker.types.TensorData(
                            data=target_weights, dtype="float32", shape=[len(tokens) - 1]
                        ),
                    },
                )
            )
            batch.trained_tokens += sum(1 for w in target_weights if w > 0)
            batch.total_tokens += len(tokens)
        batch.used += 1
    violations.raise_if_any()
    return batch


async def build_batch(
    request: trainer_service_pb2.TrainRequest, current_version: int, codec: ChatCodec
) -> Batch:
    """The request's datums (RL for groups, supervised for examples), built on the rendering threads."""
    if request.groups:
        return await off_loop(lambda: rl_batch(request, current_version, codec))
    return await off_loop(lambda: sft_batch(request, codec))
