"""A KL reference or distillation teacher named by version survives retention for as long as a model
trains against it, through a real serve on tiny-chat that keeps 2 sampler versions: a run of more RL
steps than that keeps training against version 1 and reports each step's KL (without the pins the third
step is refused: retention deleted version 1); a restarted serve keeps the pins; a version deleted before
any Train named it is FAILED_PRECONDITION naming the field, nothing trained; version 0 is the base model
and needs no checkpoint."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
from svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    error_info,
    prompt_logprobs,
    rl_request,
    sample_chat,
    yes_no_sft_request,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2

pytestmark = pytest.mark.process

KEEP = 2
PROMPT = "respond with yes"
STUDENT = "pinned-student"
TEACHER = "pinned-teacher"
# More RL steps than retention keeps versions, with the teacher moving on as many.
RL_STEPS = KEEP + 3
Stub = trainer_service_pb2_grpc.TrainerServiceStub


class Serve:
    """The module's serve, restarted on the same data directory by `restart`."""

    def __init__(self, data: Path, model_dir: Path) -> None:
        self._data, self._model_dir = data, model_dir
        self.server = self._start("serve.log")

    def _start(self, log: str) -> Server:
        return Server(
            self._data / "data", self._model_dir, self._data / log, None, "--keep-sampler-versions", str(KEEP)
        )

    @property
    def stub(self) -> Stub:
        return self.server.stub

    def restart(self) -> None:
        assert self.server.close() == 0, self.server.proc.log()[-3000:]
        self.server = self._start("serve-restarted.log")


@pytest.fixture(scope="module")
def serve(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[Serve]:
    running = Serve(tmp_path_factory.mktemp("reference-pins"), service_model_dir)
    yield running
    assert running.server.close() == 0, running.server.proc.log()[-3000:]


def _info(stub: Stub, model: str) -> types_pb2.ModelInfo:
    return stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT).model


def _version_ref(version: int, model: str = "") -> types_pb2.PolicyReference:
    return types_pb2.PolicyReference(
        version=types_pb2.PolicyVersionReference(model=model, policy_version=version)
    )


def _kl(version: int) -> types_pb2.KLPenalty:
    return types_pb2.KLPenalty(coefficient=0.5, reference=_version_ref(version))


def _rl_step(
    stub: Stub,
    seed: int,
    scored_by: tuple[str, int] = (STUDENT, 1),
    **terms: types_pb2.KLPenalty | types_pb2.Distillation,
) -> pb.TrainResponse:
    """One RL step of STUDENT on its own fresh samples, with the given per-token terms; with a KL penalty,
    the KL it reports is checked against the sampler's logprobs of the sampled tokens minus those of
    `scored_by` (a model and version, sampled for its prompt logprobs)."""
    version = _info(stub, STUDENT).policy_version
    sample = sample_chat(stub, STUDENT, PROMPT, n=2, max_tokens=4, seed=seed, version=version)
    request = rl_request(STUDENT, sample, [1.0, 0.0], learning_rate=1e-2)
    for name, term in terms.items():
        getattr(request, name).CopyFrom(term)
    response = stub.Train(request, timeout=CALL_TIMEOUT)
    assert response.policy_version == version + 1
    if "kl_penalty" in terms:
        prompt = list(sample.prompt_token_ids)
        gaps = [
            np.array(s.logprobs)
            - np.array(
                prompt_logprobs(stub, scored_by[0], prompt + list(s.token_ids), scored_by[1])[
                    len(prompt) - 1 :
                ]
            )
            for s in sample.sequences
        ]
        assert response.metrics.HasField("reference_kl")
        assert response.metrics.reference_kl == pytest.approx(
            float(np.concatenate(gaps).mean()), rel=1e-3, abs=1e-4
        )
    return response


def test_a_run_longer_than_retention_keeps_training_against_an_early_reference_and_teacher(
    serve: Serve,
) -> None:
    stub = serve.stub
    for model in (STUDENT, TEACHER):
        create_model(stub, model, rank=1)
        stub.Train(yes_no_sft_request(model, 3e-2), timeout=CALL_TIMEOUT)
    teacher = types_pb2.Distillation(teacher=_version_ref(1, TEACHER), coefficient=0.5)
    for step in range(RL_STEPS):
        # The teacher trains on too: its own commits prune all but its latest versions and pinned ones.
        stub.Train(yes_no_sft_request(TEACHER, 1e-2), timeout=CALL_TIMEOUT)
        response = _rl_step(stub, seed=step, kl_penalty=_kl(1), distillation=teacher)
        assert response.metrics.HasField("teacher_kl")

    last = 1 + RL_STEPS
    assert list(_info(stub, STUDENT).sampleable_versions) == [1, last - 1, last]
    assert list(_info(stub, TEACHER).sampleable_versions) == [1, last - 1, last]
    # Supervised steps between RL steps keep the reference (a Train without the term keeps its pin).
    for _ in range(KEEP + 1):
        stub.Train(yes_no_sft_request(STUDENT, 1e-3), timeout=CALL_TIMEOUT)
    assert 1 in _info(stub, STUDENT).sampleable_versions


def test_a_version_deleted_before_any_train_named_it_is_refused_naming_the_field(serve: Serve) -> None:
    stub = serve.stub
    model = "pinned-too-late"
    create_model(stub, model, rank=1)
    for _ in range(KEEP + 2):
        stub.Train(yes_no_sft_request(model, 1e-3), timeout=CALL_TIMEOUT)
    info = _info(stub, model)
    assert 1 not in info.sampleable_versions
    sample = sample_chat(stub, model, PROMPT, n=2, max_tokens=4, seed=3, version=info.policy_version)
    request = rl_request(model, sample, [1.0, 0.0])
    request.kl_penalty.CopyFrom(_kl(1))

    with pytest.raises(grpc.RpcError) as refused:
        stub.Train(request, timeout=CALL_TIMEOUT)

    assert refused.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "kl_penalty.reference.version.policy_version" in refused.value.details()
    reason = error_info(refused.value)
    assert reason.reason == "REFERENCE_NOT_KEPT"
    assert reason.metadata["field"] == "kl_penalty.reference.version.policy_version"
    assert (reason.metadata["model"], reason.metadata["policy_version"]) == (model, "1")
    assert _info(stub, model).policy_version == info.policy_version
    # A version after the model's own is a bad field: INVALID_ARGUMENT.
    request.kl_penalty.reference.version.policy_version = info.policy_version + 1
    with pytest.raises(grpc.RpcError) as refused:
        stub.Train(request, timeout=CALL_TIMEOUT)
    assert refused.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert _info(stub, model).policy_version == info.policy_version


def test_a_restarted_serve_keeps_the_pins_and_version_0_needs_no_checkpoint(serve: Serve) -> None:
    serve.restart()
    stub = serve.stub
    # Commits after the restart prune by the pins the store kept.
    for _ in range(KEEP + 1):
        stub.Train(yes_no_sft_request(STUDENT, 1e-3), timeout=CALL_TIMEOUT)
        stub.Train(yes_no_sft_request(TEACHER, 1e-3), timeout=CALL_TIMEOUT)
    assert 1 in _info(stub, STUDENT).sampleable_versions
    assert 1 in _info(stub, TEACHER).sampleable_versions
    _rl_step(stub, seed=50, kl_penalty=_kl(1))

    # Version 0 is the base model exactly (LoRA's B starts at zero): it scores with no checkpoint, as a
    # fresh model's version 0 does.
    assert 0 not in _info(stub, STUDENT).sampleable_versions
    create_model(stub, "pinned-fresh", rank=1)
    at_zero = _rl_step(stub, seed=51, scored_by=("pinned-fresh", 0), kl_penalty=_kl(0))
    assert at_zero.metrics.reference_kl > 0
    # That step released the KL term's pin of version 1 (the teacher's stays): the next commits prune it.
    for _ in range(KEEP):
        stub.Train(yes_no_sft_request(STUDENT, 1e-3), timeout=CALL_TIMEOUT)
        stub.Train(yes_no_sft_request(TEACHER, 1e-3), timeout=CALL_TIMEOUT)
    assert 1 not in _info(stub, STUDENT).sampleable_versions
    assert 1 in _info(stub, TEACHER).sampleable_versions
