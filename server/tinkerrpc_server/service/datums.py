"""Train requests → Tinker Datums: staleness, group advantages, token-exact RL datums per sampled turn,
and supervised datums from the renderer's weights. Pure CPU work that runs before the backend is touched,
off the event loop (build_batch).

Merged turns: when a trajectory's next turn reads the previous turn's whole sequence (prompt + completion)
as the start of its prompt (the usual case with tools), the two train as ONE datum of the later sequence,
each turn's loss inputs on its own completion positions and zeros on the tokens between (tool results,
user turns, template tokens). Every loss is a sum over positions (no per-datum or per-token mean) and
advantages, the estimator's and the aggregation's weight included, are fixed per trajectory before any
datum is built; every loss but DRO adds nothing at a position without advantage (or weight), and a
causal model reads a prefix the same inside a longer sequence, so the merged datum trains exactly as the
separate ones while the shared history is processed once instead of once per turn. Where a turn's prompt does not continue the previous sequence (a renderer stripped earlier
thinking, history was edited), the chain breaks there and a new datum starts. Supervised examples that
continue each other (renderers without the extension property) merge the same way."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import tinker
from tinker_cookbook.renderers import TrainOnWhat

from tinkerrpc.contract.estimators import AdvantageEstimatorName, LossAggregationName
from tinkerrpc.contract.limits import ADVANTAGE_STD_EPSILON
from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.service.errors import STALE_POLICY_VERSION, Violations, failed_precondition
from tinkerrpc_server.service.rendering import ChatCodec, off_loop
from tinkerrpc_server.service.train_options import advantage_estimator, loss_aggregation


@dataclass
class Batch:
    datums: list[tinker.types.Datum] = field(default_factory=list)
    # Per datum, which target positions predict a sampled (completion) token: where the sampler/learner
    # mismatch is measured. All False for supervised datums.
    sampled_masks: list[list[bool]] = field(default_factory=list)
    # Per datum, the loss aggregation's weight on its advantages (1 for supervised datums): a per-token
    # term added after the datums are built (service/train_terms.py) is weighted alike.
    advantage_weights: list[float] = field(default_factory=list)
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
    # Supervised batches: after each example, how many datums the batch held (its minibatch boundaries).
    example_ends: list[int] = field(default_factory=list)


def group_advantages(rewards: list[float], estimator: AdvantageEstimatorName) -> list[float] | None:
    """The group's advantages by the contract's estimator row; None for a zero-variance group (and, for
    leave_one_out, a group of one: no other reward to compare with)."""
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if all(abs(c) == 0.0 for c in centred) or (estimator == "leave_one_out" and len(rewards) == 1):
        return None
    if estimator == "group_mean_std":
        std = math.sqrt(sum(c * c for c in centred) / len(centred))
        return [c / (std + ADVANTAGE_STD_EPSILON) for c in centred]
    if estimator == "leave_one_out":
        # r_i − (Σ r − r_i) / (n − 1) = n / (n − 1) · (r_i − mean)
        return [c * len(rewards) / (len(rewards) - 1) for c in centred]
    return centred


def aggregation_weights(sampled_tokens: list[int], aggregation: LossAggregationName) -> list[float]:
    """Each trajectory's weight on its advantages (its sampled tokens given per trajectory), by the
    contract's aggregation row: Tinker's losses sum over tokens, so a mean is a weighted sum."""
    if aggregation == "token_mean":
        return [1.0 / sum(sampled_tokens)] * len(sampled_tokens)
    if aggregation == "sequence_mean":
        return [1.0 / (len(sampled_tokens) * tokens) for tokens in sampled_tokens]
    return [1.0] * len(sampled_tokens)


def _staleness(trajectory: types_pb2.Trajectory, current_version: int) -> int:
    return current_version - min(turn.policy_version for turn in trajectory.turns)


# Conversations already rendered in one request, by their serialized messages and tools: a group's
# trajectories share their prompt, which then renders once instead of once per trajectory.
RenderedPrompts = dict[bytes, list[int]]


def turn_prompt(
    trajectory: types_pb2.Trajectory,
    turn_index: int,
    codec: ChatCodec,
    rendered: RenderedPrompts | None = None,
) -> list[int]:
    """The turn's prompt ids, or (only when it carries none) the conversation before its assistant message,
    re-rendered with the model's renderer (once per distinct conversation in `rendered`)."""
    turn = trajectory.turns[turn_index]
    if turn.prompt_token_ids:
        return list(turn.prompt_token_ids)
    assistant_positions = [i for i, m in enumerate(trajectory.messages) if m.role == types_pb2.ROLE_ASSISTANT]
    history = list(trajectory.messages[: assistant_positions[turn_index]])
    if rendered is None:
        return codec.generation_prompt(history, list(trajectory.tools))
    key = types_pb2.Trajectory(messages=history, tools=trajectory.tools).SerializeToString(deterministic=True)
    if key not in rendered:
        rendered[key] = codec.generation_prompt(history, list(trajectory.tools))
    return list(rendered[key])


@dataclass
class _Sequence:
    """One datum before Tinker's types: its tokens, and each float loss input per target position (one
    fewer than tokens); the positions before `trained_from` carry no loss; `sampled` marks the target
    positions of sampled tokens (none for supervised sequences)."""

    tokens: list[int]
    inputs: dict[str, list[float]]
    trained_from: int
    sampled: list[bool] = field(default_factory=list)

    def continued_by(self, later: _Sequence) -> bool:
        """`later` reads this whole sequence as its prefix and trains only after it: one datum of
        `later`'s tokens carrying both sequences' loss inputs then trains exactly as the two."""
        return later.trained_from >= len(self.tokens) - 1 and later.tokens[: len(self.tokens)] == self.tokens

    def extended_by(self, later: _Sequence) -> _Sequence:
        kept = len(self.tokens) - 1
        return _Sequence(
            later.tokens,
            {name: values + later.inputs[name][kept:] for name, values in self.inputs.items()},
            self.trained_from,
            self.sampled + later.sampled[kept:],
        )

    def datum(self) -> tinker.types.Datum:
        positions = len(self.tokens) - 1
        loss_fn_inputs = {
            "target_tokens": tinker.types.TensorData(data=self.tokens[1:], dtype="int64", shape=[positions])
        }
        for name, values in self.inputs.items():
            loss_fn_inputs[name] = tinker.types.TensorData(data=values, dtype="float32", shape=[positions])
        return tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints(self.tokens[:-1]), loss_fn_inputs=loss_fn_inputs
        )


def _turn_sequence(
    prompt: list[int], turn: types_pb2.SampledTurn, advantage: float, ratio_mask: bool
) -> _Sequence:
    """Position i predicts token i + 1: the sampler's logprobs and the advantage (plus the turn's own
    per-token advantages) sit on the completion's targets, zeros on the len(prompt) − 1 prompt positions;
    with ratio_mask, gspo's sequence_ratio_mask marks the sampled targets, so a datum's sequence ratio is
    taken over its sampled tokens only."""
    completion = list(turn.completion_token_ids)
    prompt_positions = len(prompt) - 1
    token_advantages = list(turn.advantages) or [0.0] * len(completion)
    inputs = {
        "logprobs": [0.0] * prompt_positions + list(turn.completion_logprobs),
        "advantages": [0.0] * prompt_positions + [advantage + a for a in token_advantages],
    }
    if ratio_mask:
        inputs["sequence_ratio_mask"] = [0.0] * prompt_positions + [1.0] * len(completion)
    sampled = [False] * prompt_positions + [True] * len(completion)
    return _Sequence(prompt + completion, inputs, prompt_positions, sampled)


def _merged(sequences: list[_Sequence]) -> list[_Sequence]:
    """Each run of sequences that continue one another as one sequence; a break starts a new one."""
    merged: list[_Sequence] = []
    for sequence in sequences:
        if merged and merged[-1].continued_by(sequence):
            merged[-1] = merged[-1].extended_by(sequence)
        else:
            merged.append(sequence)
    return merged


def _add(batch: Batch, sequences: list[_Sequence], merge: bool, weight: float = 1.0) -> None:
    for sequence in _merged(sequences) if merge else sequences:
        batch.datums.append(sequence.datum())
        batch.advantage_weights.append(weight)
        batch.sampled_masks.append(sequence.sampled or [False] * (len(sequence.tokens) - 1))
        batch.total_tokens += len(sequence.tokens)


def rl_batch(
    request: trainer_service_pb2.TrainRequest,
    current_version: int,
    codec: ChatCodec,
    merge_turns: bool = True,
) -> Batch:
    """The groups' datums; merge_turns=False (a diagnostic switch: the bench's baseline) keeps one datum
    per sampled turn even where turns continue one another."""
    batch = Batch()
    # DRO's drift term ½·β·(lp − q)² counts on every position, prompt included (q = 0 there), so separate
    # datums count the shared history once per turn, each time against q = 0: a single datum cannot
    # reproduce that loss (its lp² coefficient grows with the number of turns), so DRO stays per turn.
    # GSPO's ratio is one geometric mean per datum: a merged datum would average over all its turns, so
    # each sampled turn stays its own sequence.
    merge = merge_turns and request.loss.function not in (
        types_pb2.LOSS_FUNCTION_DRO,
        types_pb2.LOSS_FUNCTION_GSPO,
    )
    ratio_mask = request.loss.function == types_pb2.LOSS_FUNCTION_GSPO
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

    estimator = advantage_estimator(request)
    # A KL penalty or distillation gives every sampled token a signal of its own.
    per_token_terms = request.HasField("kl_penalty") or request.HasField("distillation")
    # Each trained trajectory's sequences and sampled tokens, weighted once all are known.
    trained: list[tuple[list[_Sequence], int]] = []
    violations = Violations()
    rendered: RenderedPrompts = {}
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
        advantages = group_advantages([tr.reward for _, tr in fresh], estimator)
        if advantages is None:
            # Without a reward signal the group still trains on its per-token terms, if it has any.
            if not (per_token_terms or any(turn.advantages for _, tr in fresh for turn in tr.turns)):
                batch.zero_variance_groups += 1
                batch.dropped_zero_variance += len(fresh)
                continue
            advantages = [0.0] * len(fresh)
        for (t, trajectory), advantage in zip(fresh, advantages, strict=True):
            sequences = []
            sampled = 0
            for k, turn in enumerate(trajectory.turns):
                prompt = turn_prompt(trajectory, k, codec, rendered)
                length = len(prompt) + len(turn.completion_token_ids)
                if length > codec.max_context_length:
                    violations.add(
                        f"groups[{g}].trajectories[{t}].turns[{k}]",
                        f"{length} tokens exceed the model's context of {codec.max_context_length}",
                    )
                    continue
                sequences.append(_turn_sequence(prompt, turn, advantage, ratio_mask))
                sampled += len(turn.completion_token_ids)
            trained.append((sequences, sampled))
    violations.raise_if_any()
    weights = aggregation_weights([sampled for _, sampled in trained], loss_aggregation(request))
    for (sequences, sampled), weight in zip(trained, weights, strict=True):
        if weight != 1.0:
            for sequence in sequences:
                sequence.inputs["advantages"] = [a * weight for a in sequence.inputs["advantages"]]
        _add(batch, sequences, merge, weight)
        batch.trained_tokens += sampled
        batch.used += 1
    return batch


_TRAIN_ON = {
    types_pb2.TRAIN_ON_UNSPECIFIED: TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    types_pb2.TRAIN_ON_ALL_ASSISTANT_MESSAGES: TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    types_pb2.TRAIN_ON_LAST_ASSISTANT_MESSAGE: TrainOnWhat.LAST_ASSISTANT_MESSAGE,
}


def sft_batch(request: trainer_service_pb2.TrainRequest, codec: ChatCodec, merge_turns: bool = True) -> Batch:
    """The examples' datums; merge_turns=False keeps one datum per example the renderer makes."""
    batch = Batch()
    violations = Violations()
    # Identical examples (a warm-up drawing from a few prompts and answers) render once: by their bytes.
    rendered: dict[bytes, list[tuple[list[int], list[float]]]] = {}
    for e, example in enumerate(request.examples):
        key = example.SerializeToString(deterministic=True)
        if key not in rendered:
            rendered[key] = codec.supervised_examples(
                list(example.messages), list(example.tools), _TRAIN_ON[example.train_on]
            )
        sequences = []
        for tokens, weights in rendered[key]:
            if len(tokens) > codec.max_context_length:
                violations.add(
                    f"examples[{e}]",
                    f"{len(tokens)} tokens exceed the model's context of {codec.max_context_length}",
                )
                continue
            target_weights = weights[1:]
            trained_from = next((i for i, w in enumerate(target_weights) if w != 0), len(target_weights))
            sequences.append(_Sequence(tokens, {"weights": target_weights}, trained_from))
            batch.trained_tokens += sum(1 for w in target_weights if w > 0)
        _add(batch, sequences, merge_turns)
        batch.example_ends.append(len(batch.datums))
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
