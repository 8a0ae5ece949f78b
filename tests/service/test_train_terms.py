"""A Train's per-token terms through a real serve on tiny-chat, each against a direct computation from the
logprobs the server returns (Sample's completion logprobs and prompt logprobs at a version): the KL
penalty's reported KL and the loss of its advantages, and that it moves the policy toward its reference
beside the same step without it; distillation's teacher KL and loss, and the student moving toward the
teacher with no reward; given per-token advantages in a group of equal rewards; truncated importance
sampling's capped fraction and loss; and the bad input each refuses, nothing trained."""

from __future__ import annotations

import math

import grpc
import numpy as np
import pytest
from svc import (
    CALL_TIMEOUT,
    TINY,
    Server,
    create_model,
    prompt_logprobs,
    rl_request,
    sample_chat,
    violated_fields,
    yes_no_sft_request,
)

from tinkerrpc.contract.limits import DEFAULT_DISTILLATION_COEFFICIENT
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2

pytestmark = pytest.mark.process

TEACHER = "terms-teacher"
STUDENT = "terms-student"
PROMPT = "respond with yes"
Stub = trainer_service_pb2_grpc.TrainerServiceStub


@pytest.fixture(scope="module")
def stub(server: Server) -> Stub:
    """TEACHER trained away from its base by three supervised steps; STUDENT fresh at version 0."""
    create_model(server.stub, TEACHER)
    for _ in range(3):
        server.stub.Train(yes_no_sft_request(TEACHER, 3e-2), timeout=CALL_TIMEOUT)
    create_model(server.stub, STUDENT)
    return server.stub


def _version(stub: Stub, model: str) -> int:
    return stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT).model.policy_version


def _scored(stub: Stub, model: str, sample: pb.SampleResponse, version: int) -> list[np.ndarray]:
    """Per sampled sequence, the policy's logprobs of its completion tokens at `version`."""
    prompt = list(sample.prompt_token_ids)
    return [
        np.array(prompt_logprobs(stub, model, prompt + list(s.token_ids), version)[len(prompt) - 1 :])
        for s in sample.sequences
    ]


def _sampled(sample: pb.SampleResponse) -> list[np.ndarray]:
    return [np.array(s.logprobs, dtype=np.float64) for s in sample.sequences]


def _is_loss(learner: list[np.ndarray], sampler: list[np.ndarray], advantages: list[np.ndarray]) -> float:
    """importance_sampling's −Σ exp(lp − q)·A."""
    return float(
        -sum((np.exp(lp - q) * a).sum() for lp, q, a in zip(learner, sampler, advantages, strict=True))
    )


def _kl_to_base(stub: Stub, version: int) -> float:
    """KL(policy at `version` ‖ its base) estimated on 16 fresh samples of it: the mean over their tokens
    of the policy's logprob minus the base's (version 0: the base with a zero adapter)."""
    sample = sample_chat(stub, TEACHER, PROMPT, n=16, max_tokens=6, seed=21, version=version)
    base = _scored(stub, TEACHER, sample, 0)
    return float(np.concatenate([q - b for q, b in zip(_sampled(sample), base, strict=True)]).mean())


def test_a_kl_penalty_reports_the_kl_trains_its_advantages_and_moves_the_policy_toward_the_reference(
    stub: Stub,
) -> None:
    version = _version(stub, TEACHER)
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=TEACHER, name="before-kl"), timeout=CALL_TIMEOUT)
    sample = sample_chat(stub, TEACHER, PROMPT, n=4, max_tokens=6, seed=5, version=version)
    rewards = [1.0, 0.0, 1.0, 0.0]
    coefficient = 2.0
    sampler = _sampled(sample)
    # Version 0 is the base model with a zero adapter: the reference's logprobs.
    reference = _scored(stub, TEACHER, sample, 0)
    learner = _scored(stub, TEACHER, sample, version)
    gaps = [q - ref for q, ref in zip(sampler, reference, strict=True)]
    mean_gap = float(np.concatenate(gaps).mean())
    advantages = [r - 0.5 + coefficient * (mean_gap - d) for r, d in zip(rewards, gaps, strict=True)]

    request = rl_request(TEACHER, sample, rewards, learning_rate=1e-2)
    with_kl = pb.TrainRequest()
    with_kl.CopyFrom(request)
    with_kl.kl_penalty.coefficient = coefficient
    with_kl.kl_penalty.reference.base_model = TINY
    response = stub.Train(with_kl, timeout=CALL_TIMEOUT)

    assert response.metrics.HasField("reference_kl") and not response.metrics.HasField("teacher_kl")
    assert response.metrics.reference_kl == pytest.approx(mean_gap, rel=1e-3, abs=1e-4)
    assert mean_gap > 0.05, "the trained policy's own samples are likelier under it than under its base"
    assert response.metrics.loss == pytest.approx(_is_loss(learner, sampler, advantages), rel=1e-3, abs=1e-3)
    history = stub.GetRunHistory(
        pb.GetRunHistoryRequest(model=TEACHER, from_version=response.policy_version), timeout=CALL_TIMEOUT
    )
    assert history.steps[0].metrics.reference_kl == response.metrics.reference_kl
    after_kl = _kl_to_base(stub, response.policy_version)

    # The same step without the penalty, from the same state.
    stub.RestoreCheckpoint(
        pb.RestoreCheckpointRequest(model=TEACHER, checkpoint="before-kl"), timeout=CALL_TIMEOUT
    )
    plain = stub.Train(request, timeout=CALL_TIMEOUT)
    assert plain.policy_version == response.policy_version and not plain.metrics.HasField("reference_kl")
    after_plain = _kl_to_base(stub, plain.policy_version)

    before = _kl_to_base(stub, version)
    assert after_kl < before and after_kl < after_plain, (before, after_kl, after_plain)


def test_the_reference_may_be_a_version_or_a_checkpoint(stub: Stub) -> None:
    version = _version(stub, TEACHER)
    sample = sample_chat(stub, TEACHER, PROMPT, n=2, max_tokens=5, seed=9, version=version)
    sampler = _sampled(sample)
    at_zero = _scored(stub, TEACHER, sample, 0)
    at_version = _scored(stub, TEACHER, sample, version)
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=TEACHER, name="reference"), timeout=CALL_TIMEOUT)
    expected = {
        "version": float(np.concatenate([q - r for q, r in zip(sampler, at_zero, strict=True)]).mean()),
        "checkpoint": float(np.concatenate([q - r for q, r in zip(sampler, at_version, strict=True)]).mean()),
    }
    for kind, reference in (
        ("version", types_pb2.PolicyReference(version=types_pb2.PolicyVersionReference(policy_version=0))),
        ("checkpoint", types_pb2.PolicyReference(checkpoint=types_pb2.CheckpointReference(name="reference"))),
    ):
        request = rl_request(TEACHER, sample, [1.0, 0.0], learning_rate=1e-4)
        request.kl_penalty.CopyFrom(types_pb2.KLPenalty(coefficient=0.1, reference=reference))
        response = stub.Train(request, timeout=CALL_TIMEOUT)
        assert response.metrics.reference_kl == pytest.approx(expected[kind], rel=1e-3, abs=1e-4), kind
    # A state checkpoint of the sampled version scores as the sampler did: no KL to speak of.
    assert abs(expected["checkpoint"]) < 1e-3


def test_distillation_trains_the_teachers_logprob_gap_and_moves_the_student_toward_it(stub: Stub) -> None:
    teacher_version = _version(stub, TEACHER)
    sample = sample_chat(stub, STUDENT, PROMPT, n=4, max_tokens=6, seed=3, version=0)
    sampler = _sampled(sample)
    teacher = _scored(stub, TEACHER, sample, teacher_version)
    learner = _scored(stub, STUDENT, sample, 0)
    request = rl_request(STUDENT, sample, [0.0] * 4, learning_rate=1e-2)
    request.distillation.teacher.version.model = TEACHER
    request.distillation.teacher.version.policy_version = teacher_version

    response = stub.Train(request, timeout=CALL_TIMEOUT)

    reverse_kl = float(np.concatenate([q - p for q, p in zip(sampler, teacher, strict=True)]).mean())
    assert response.metrics.teacher_kl == pytest.approx(reverse_kl, rel=1e-3, abs=1e-4)
    assert reverse_kl > 0.05
    # No reward function: the group's rewards are equal and it trains on the teacher's term alone.
    assert (response.metrics.trajectories_used, response.metrics.dropped_zero_variance) == (4, 0)
    advantages = [DEFAULT_DISTILLATION_COEFFICIENT * (p - q) for q, p in zip(sampler, teacher, strict=True)]
    assert response.metrics.loss == pytest.approx(_is_loss(learner, sampler, advantages), rel=1e-3, abs=1e-3)
    after = _scored(stub, STUDENT, sample, response.policy_version)
    moved = float(np.concatenate([lp - p for lp, p in zip(after, teacher, strict=True)]).mean())
    assert moved < reverse_kl


def test_given_per_token_advantages_train_a_group_of_equal_rewards(stub: Stub) -> None:
    version = _version(stub, STUDENT)
    sample = sample_chat(stub, STUDENT, PROMPT, n=3, max_tokens=5, seed=11, version=version)
    sampler = _sampled(sample)
    learner = _scored(stub, STUDENT, sample, version)
    request = rl_request(STUDENT, sample, [1.0] * 3, learning_rate=1e-3)
    given = [np.array([(-1.0) ** i * (0.5 + i) for i in range(len(q))]) for q in sampler]
    for trajectory, advantages in zip(request.groups[0].trajectories, given, strict=True):
        trajectory.turns[0].advantages.extend(advantages.tolist())

    response = stub.Train(request, timeout=CALL_TIMEOUT)

    assert (response.metrics.trajectories_used, response.metrics.zero_variance_groups) == (3, 0)
    assert response.metrics.loss == pytest.approx(_is_loss(learner, sampler, given), rel=1e-3, abs=1e-3)


def test_a_ratio_cap_trains_truncated_importance_sampling_and_reports_the_capped_fraction(stub: Stub) -> None:
    version = _version(stub, STUDENT)
    sample = sample_chat(stub, STUDENT, PROMPT, n=4, max_tokens=6, seed=5, version=version)
    learner = _scored(stub, STUDENT, sample, version)
    rewards = [1.0, 0.0, 0.5, 0.0]
    request = rl_request(STUDENT, sample, rewards, learning_rate=1e-3)
    sent = []
    # Sent logprobs lowered by these shifts: ratios of about 1, e^0.25, e and e^2 against a cap of 2.
    for trajectory, sequence, shift in zip(
        request.groups[0].trajectories, sample.sequences, (0, 0.25, 1, 2), strict=True
    ):
        del trajectory.turns[0].completion_logprobs[:]
        trajectory.turns[0].completion_logprobs.extend(lp - shift for lp in sequence.logprobs)
        sent.append(np.array(trajectory.turns[0].completion_logprobs, dtype=np.float64))
    cap = 2.0
    request.importance_ratio_cap = cap

    response = stub.Train(request, timeout=CALL_TIMEOUT)

    ratios = np.concatenate([np.exp(lp - q) for lp, q in zip(learner, sent, strict=True)])
    mismatch = response.metrics.sampler_mismatch
    assert mismatch.ratio_cap == cap
    assert mismatch.capped_fraction == pytest.approx(float(np.mean(ratios > cap)))
    assert 0 < mismatch.capped_fraction < 1
    # cispo's −Σ sg(min(r, cap))·lp·A: the step's loss.
    expected = -sum(
        (np.minimum(np.exp(lp - q), cap) * lp * (r - 0.375)).sum()
        for lp, q, r in zip(learner, sent, rewards, strict=True)
    )
    assert response.metrics.loss == pytest.approx(expected, rel=1e-3, abs=1e-3)


@pytest.mark.parametrize(
    ("field", "set_option"),
    [
        ("kl_penalty.coefficient", lambda r: r.kl_penalty.SetInParent()),
        ("kl_penalty.coefficient", lambda r: setattr(r.kl_penalty, "coefficient", math.nan)),
        ("kl_penalty.coefficient", lambda r: setattr(r.kl_penalty, "coefficient", 101.0)),
        ("kl_penalty.reference", lambda r: (setattr(r.kl_penalty, "coefficient", 1.0), r.kl_penalty.reference.SetInParent())),
        ("kl_penalty.reference.base_model", lambda r: (setattr(r.kl_penalty, "coefficient", 1.0), setattr(r.kl_penalty.reference, "base_model", "no/such-model"))),
        ("kl_penalty.reference.version.policy_version", lambda r: (setattr(r.kl_penalty, "coefficient", 1.0), setattr(r.kl_penalty.reference.version, "policy_version", 999))),
        ("kl_penalty.reference.version.model", lambda r: (setattr(r.kl_penalty, "coefficient", 1.0), setattr(r.kl_penalty.reference.version, "model", "nobody"))),
        ("distillation.teacher", lambda r: r.distillation.SetInParent()),
        ("distillation.teacher.checkpoint.name", lambda r: setattr(r.distillation.teacher.checkpoint, "name", "no-such")),
        ("distillation.coefficient", lambda r: (setattr(r.distillation.teacher, "base_model", TINY), setattr(r.distillation, "coefficient", 0.0))),
        ("importance_ratio_cap", lambda r: setattr(r, "importance_ratio_cap", 0.5)),
        ("importance_ratio_cap", lambda r: (setattr(r, "importance_ratio_cap", 2.0), setattr(r.loss, "function", types_pb2.LOSS_FUNCTION_PPO))),
        ("groups[0].trajectories[0].turns[0].advantages", lambda r: r.groups[0].trajectories[0].turns[0].advantages.append(1.0)),
        ("groups[0].trajectories[1].turns[0].advantages", lambda r: r.groups[0].trajectories[1].turns[0].advantages.extend([math.inf] * len(r.groups[0].trajectories[1].turns[0].completion_token_ids))),
    ],
)  # fmt: skip
def test_bad_options_are_refused_naming_the_field_and_nothing_trains(
    stub: Stub, field: str, set_option
) -> None:  # type: ignore[no-untyped-def]
    version = _version(stub, STUDENT)
    sample = sample_chat(stub, STUDENT, PROMPT, n=2, max_tokens=4, seed=2, version=version)
    request = rl_request(STUDENT, sample, [1.0, 0.0])
    set_option(request)

    with pytest.raises(grpc.RpcError) as refused:
        stub.Train(request, timeout=CALL_TIMEOUT)

    assert field in violated_fields(refused.value)
    assert _version(stub, STUDENT) == version
