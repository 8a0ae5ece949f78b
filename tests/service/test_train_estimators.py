"""Each advantage estimator and loss aggregation through a real serve: twin models (same base, same seed,
version 0) each take one importance-sampling step on the same sampled group with one option; the step is
accepted, reports the loss worked out here from the policy's own logprobs of the data with the option's
advantages and weights (numpy, independent of the service), and moves the policy."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
from svc import CALL_TIMEOUT, Server, create_model, prompt_logprobs, rl_request, sample_chat

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

REWARDS = np.array([1.0, 0.0, 0.5, 0.0])
# Added to the sampler's logprobs from position i of trajectory i on, so that the importance ratios differ
# from 1 and each trajectory's sum of them from the others' (more offsets than sampled tokens).
OFFSETS = [-0.4, 0.25, -0.1, 0.35, 0.05, -0.3, 0.6, -0.55]
LOSS_TOLERANCE = 2e-4
# (model suffix, estimator, aggregation): each option once, the others at their defaults.
OPTIONS = [
    ("group-mean", "group_mean", "token_sum"),
    ("group-mean-std", "group_mean_std", "token_sum"),
    ("leave-one-out", "leave_one_out", "token_sum"),
    ("token-mean", "group_mean", "token_mean"),
    ("sequence-mean", "group_mean", "sequence_mean"),
]


def reference_advantages(estimator: str) -> np.ndarray:
    centred = REWARDS - REWARDS.mean()
    if estimator == "group_mean_std":
        return centred / (REWARDS.std() + 1e-6)
    if estimator == "leave_one_out":
        return REWARDS - (REWARDS.sum() - REWARDS) / (len(REWARDS) - 1)
    return centred


def reference_loss(lp: list[np.ndarray], q: list[np.ndarray], estimator: str, aggregation: str) -> float:
    """−Σ_i w_i·A_i·Σ_t exp(lp − q) over trajectory i's sampled tokens."""
    tokens = np.array([len(x) for x in lp])
    weights = {
        "token_sum": np.ones(len(tokens)),
        "token_mean": np.full(len(tokens), 1.0 / tokens.sum()),
        "sequence_mean": 1.0 / (len(tokens) * tokens),
    }[aggregation]
    ratios = [np.exp(a - b).sum() for a, b in zip(lp, q, strict=True)]
    return float(-(weights * reference_advantages(estimator) * np.array(ratios)).sum())


@pytest.fixture(scope="module")
def stub(server: Server) -> object:
    for suffix, _, _ in OPTIONS:
        create_model(server.stub, f"estimator-{suffix}")
    return server.stub


def test_each_option_trains_by_its_reference_loss_and_moves_the_policy(stub: object) -> None:
    first = f"estimator-{OPTIONS[0][0]}"
    sample = sample_chat(stub, first, "respond with maybe", n=len(REWARDS), max_tokens=6, seed=5, version=0)  # type: ignore[arg-type]
    # Trajectory i keeps its first 6 − i tokens: lengths that differ tell sequence_mean from token_mean.
    for i, sequence in enumerate(sample.sequences):
        assert len(sequence.token_ids) == 6, "the tiny model samples to max_tokens"
        del sequence.token_ids[6 - i :]
        del sequence.logprobs[6 - i :]
    prompt = list(sample.prompt_token_ids)
    sampler = [np.array(s.logprobs) for s in sample.sequences]
    q = [
        lp + np.array([OFFSETS[(2 * i + j) % len(OFFSETS)] for j in range(len(lp))])
        for i, lp in enumerate(sampler)
    ]
    learner = [
        np.array(prompt_logprobs(stub, first, prompt + list(s.token_ids), version=0)[len(prompt) - 1 :])  # type: ignore[arg-type]
        for s in sample.sequences
    ]
    expected = {suffix: reference_loss(learner, q, e, a) for suffix, e, a in OPTIONS}
    values = sorted(expected.values())
    assert min(b - a for a, b in itertools.pairwise(values)) > 20 * LOSS_TOLERANCE, expected

    probe = prompt + list(sample.sequences[0].token_ids)
    before = np.array(prompt_logprobs(stub, first, probe, version=0))  # type: ignore[arg-type]
    for suffix, estimator, aggregation in OPTIONS:
        model = f"estimator-{suffix}"
        request: pb.TrainRequest = rl_request(model, sample, list(REWARDS))
        for trajectory, shifted in zip(request.groups[0].trajectories, q, strict=True):
            trajectory.turns[0].completion_logprobs[:] = shifted.tolist()
        request.loss.function = types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING
        request.loss.aggregation = types_pb2.LossAggregation.Value(f"LOSS_AGGREGATION_{aggregation.upper()}")
        request.advantages.estimator = types_pb2.AdvantageEstimator.Value(
            f"ADVANTAGE_ESTIMATOR_{estimator.upper()}"
        )
        response = stub.Train(request, timeout=CALL_TIMEOUT)  # type: ignore[attr-defined]
        assert response.policy_version == 1
        assert response.metrics.loss == pytest.approx(expected[suffix], abs=LOSS_TOLERANCE), suffix
        after = np.array(prompt_logprobs(stub, model, probe, version=1))  # type: ignore[arg-type]
        assert np.abs(after - before).max() > 1e-4, f"{suffix} did not move the policy"
