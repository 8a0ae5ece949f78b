"""Each advantage estimator and loss aggregation of the contract's tables, in the datums Train builds
(datums.rl_batch), against a reference written here in numpy: every trained position carries the
estimator's advantage of its trajectory times the aggregation's weight, merged multi-turn trajectories
included; bad combinations are INVALID_ARGUMENT naming the field."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from svc import TINY

from tinkerrpc.contract.estimators import ADVANTAGE_ESTIMATORS, LOSS_AGGREGATIONS
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.datums import rl_batch
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs
from tinkerrpc_server.service.validation import check_train_request

pytestmark = pytest.mark.unit

STD_EPSILON = 1e-6
PROMPT = [11, 12, 13, 14]
# (reward, completion lengths of its turns); the second group's middle trajectory takes two turns, the
# second continuing the first (one merged datum); the last group has equal rewards and trains nothing.
GROUPS = [
    [(1.0, [3]), (0.0, [5]), (0.5, [2]), (0.0, [4])],
    [(0.2, [2]), (0.9, [3, 2]), (0.4, [6])],
    [(1.0, [2]), (1.0, [3])],
]


def reference_advantages(rewards: np.ndarray, estimator: str) -> np.ndarray:
    if np.all(rewards == rewards.mean()):
        return np.zeros_like(rewards)
    if estimator == "group_mean":
        return rewards - rewards.mean()
    if estimator == "group_mean_std":
        return (rewards - rewards.mean()) / (rewards.std() + STD_EPSILON)
    assert estimator == "leave_one_out"
    others = (rewards.sum() - rewards) / (len(rewards) - 1)
    return rewards - others


def reference_weights(tokens: np.ndarray, aggregation: str) -> np.ndarray:
    if aggregation == "token_sum":
        return np.ones_like(tokens, dtype=float)
    if aggregation == "token_mean":
        return np.full(len(tokens), 1.0 / tokens.sum())
    assert aggregation == "sequence_mean"
    return 1.0 / (len(tokens) * tokens)


def _request(estimator: int, aggregation: int, normalize_std: bool = False) -> pb.TrainRequest:
    request = pb.TrainRequest(
        model="m",
        loss=types_pb2.LossConfig(
            function=types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING, aggregation=aggregation
        ),  # type: ignore[arg-type]
        advantages=types_pb2.AdvantageOptions(normalize_std=normalize_std, estimator=estimator),  # type: ignore[arg-type]
        adam=types_pb2.AdamParams(learning_rate=1e-4),
    )
    token = 100
    for group in GROUPS:
        added = request.groups.add()
        for reward, lengths in group:
            trajectory = added.trajectories.add(reward=reward)
            prompt = list(PROMPT)
            for length in lengths:
                completion = list(range(token, token + length))
                token += length
                trajectory.turns.add(
                    prompt_token_ids=prompt,
                    completion_token_ids=completion,
                    completion_logprobs=[-0.5] * length,
                )
                prompt = prompt + completion + [15, 16]
    return request


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


@pytest.mark.parametrize("aggregation", LOSS_AGGREGATIONS, ids=lambda a: a.name)
@pytest.mark.parametrize("estimator", ADVANTAGE_ESTIMATORS, ids=lambda e: e.name)
def test_each_trained_position_carries_the_references_weighted_advantage(
    codec: ChatCodec, estimator: object, aggregation: object
) -> None:
    name, how = estimator.name, aggregation.name  # type: ignore[attr-defined]
    request = _request(
        types_pb2.AdvantageEstimator.Value(estimator.proto_enum),  # type: ignore[attr-defined]
        types_pb2.LossAggregation.Value(aggregation.proto_enum),  # type: ignore[attr-defined]
    )
    check_train_request(request, 0, codec.vocab_size, codec.max_context_length)
    batch = rl_batch(request, 0, codec)

    advantages = np.concatenate([reference_advantages(np.array([r for r, _ in g]), name) for g in GROUPS[:2]])
    tokens = np.array([sum(lengths) for g in GROUPS[:2] for _, lengths in g])
    expected = advantages * reference_weights(tokens, how)
    assert len(batch.datums) == len(expected), "one datum per trajectory, the two-turn one merged"
    for datum, value, count in zip(batch.datums, expected, tokens, strict=True):
        carried = np.array(datum.loss_fn_inputs["advantages"].data)
        trained = carried[carried != 0]
        assert len(trained) == count
        np.testing.assert_allclose(trained, value, rtol=1e-6)
    assert batch.trained_tokens == tokens.sum()
    assert batch.dropped_zero_variance == 2


def test_unset_estimator_is_group_mean_or_with_normalize_std_group_mean_std(codec: ChatCodec) -> None:
    def carried(request: pb.TrainRequest) -> list[float]:
        return [a for d in rl_batch(request, 0, codec).datums for a in d.loss_fn_inputs["advantages"].data]

    unspecified = types_pb2.ADVANTAGE_ESTIMATOR_UNSPECIFIED
    assert carried(_request(unspecified, 0)) == carried(_request(types_pb2.ADVANTAGE_ESTIMATOR_GROUP_MEAN, 0))
    assert carried(_request(unspecified, 0, normalize_std=True)) == carried(
        _request(types_pb2.ADVANTAGE_ESTIMATOR_GROUP_MEAN_STD, types_pb2.LOSS_AGGREGATION_TOKEN_SUM)
    )


def test_a_group_of_one_trains_nothing_with_leave_one_out(codec: ChatCodec) -> None:
    request = _request(types_pb2.ADVANTAGE_ESTIMATOR_LEAVE_ONE_OUT, 0)
    del request.groups[:2]
    del request.groups[0].trajectories[1:]
    request.groups[0].trajectories[0].reward = 0.3
    batch = rl_batch(request, 0, codec)
    assert (batch.datums, batch.dropped_zero_variance) == ([], 1)


def _refused(request: pb.TrainRequest, codec: ChatCodec) -> str:
    with pytest.raises(ServiceError) as refused:
        check_train_request(request, 0, codec.vocab_size, codec.max_context_length)
    return str(refused.value.details)


def test_bad_options_are_refused_naming_the_field(codec: ChatCodec) -> None:
    unknown_estimator = _request(99, 0)
    assert "advantages.estimator" in _refused(unknown_estimator, codec)
    assert "loss.aggregation" in _refused(_request(0, 99), codec)
    contradiction = _request(types_pb2.ADVANTAGE_ESTIMATOR_LEAVE_ONE_OUT, 0, normalize_std=True)
    assert "advantages.normalize_std" in _refused(contradiction, codec)
    dro = _request(0, types_pb2.LOSS_AGGREGATION_TOKEN_MEAN)
    dro.loss.function = types_pb2.LOSS_FUNCTION_DRO
    assert "loss.aggregation" in _refused(dro, codec)
    dro.loss.aggregation = types_pb2.LOSS_AGGREGATION_TOKEN_SUM
    check_train_request(dro, 0, codec.vocab_size, codec.max_context_length)
