"""The sampler/learner mismatch a Train reports on a real serve equals the one computed here from the
policy's own logprobs of the sampled tokens (Sample's prompt logprobs at the version the step trains),
and reaches GetRunHistory as reported; a supervised step reports none."""

from __future__ import annotations

import math

import pytest
from mismatch_reference import reference_mismatch, reported_mismatch
from svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    prompt_logprobs,
    rl_request,
    sample_chat,
    yes_no_sft_request,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc

pytestmark = pytest.mark.process

MODEL = "mismatch-model"
# What the sent sampler logprobs are lowered by, per trajectory: 0 is the sampler's own; e^2 > 2 is a
# ratio past MISMATCH_RATIO_MAX.
SHIFTS = (0.0, 0.25, 1.0, 2.0)


@pytest.fixture(scope="module")
def stub(server: Server) -> trainer_service_pb2_grpc.TrainerServiceStub:
    create_model(server.stub, MODEL)
    return server.stub


def test_the_reported_mismatch_equals_one_computed_from_the_policys_own_logprobs(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = stub.GetModel(pb.GetModelRequest(name=MODEL)).model.policy_version
    sample = sample_chat(stub, MODEL, "respond with maybe", n=4, max_tokens=6, seed=5, version=version)
    prompt = list(sample.prompt_token_ids)
    request = rl_request(MODEL, sample, [1.0, 0.0, 0.5, 0.0])
    learner: list[float] = []
    sent: list[float] = []
    for trajectory, sequence, shift in zip(
        request.groups[0].trajectories, sample.sequences, SHIFTS, strict=True
    ):
        turn = trajectory.turns[0]
        del turn.completion_logprobs[:]
        turn.completion_logprobs.extend(lp - shift for lp in sequence.logprobs)
        sent.extend(turn.completion_logprobs)
        # prompt_logprobs drops position 0: completion token j is entry len(prompt) − 1 + j.
        scored = prompt_logprobs(stub, MODEL, prompt + list(sequence.token_ids), version)
        learner.extend(scored[len(prompt) - 1 :])
    # The sampler's own logprobs are the policy's at this version: the first trajectory alone is ~0 KL.
    own = len(sample.sequences[0].token_ids)
    assert reference_mismatch(learner[:own], sent[:own])["kl"] < 1e-4

    response = stub.Train(request, timeout=CALL_TIMEOUT)

    mismatch = response.metrics.sampler_mismatch
    assert response.metrics.HasField("sampler_mismatch")
    assert mismatch.tokens == len(sent) == response.metrics.trained_tokens
    expected = reference_mismatch(learner, sent)
    assert reported_mismatch(mismatch) == pytest.approx(expected, rel=1e-3, abs=1e-5)
    assert mismatch.max_ratio > math.exp(2.0) * 0.99 and 0.0 < mismatch.outside_fraction < 1.0

    history = stub.GetRunHistory(
        pb.GetRunHistoryRequest(model=MODEL, from_version=response.policy_version), timeout=CALL_TIMEOUT
    )
    assert history.steps[0].policy_version == response.policy_version
    assert history.steps[0].metrics.sampler_mismatch == mismatch


def test_a_supervised_step_reports_no_mismatch_in_its_response_or_history(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    response = stub.Train(yes_no_sft_request(MODEL, 1e-3), timeout=CALL_TIMEOUT)

    assert not response.metrics.HasField("sampler_mismatch")
    history = stub.GetRunHistory(
        pb.GetRunHistoryRequest(model=MODEL, from_version=response.policy_version), timeout=CALL_TIMEOUT
    )
    assert not history.steps[0].metrics.HasField("sampler_mismatch")
