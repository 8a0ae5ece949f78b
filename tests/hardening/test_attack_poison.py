"""Attacks on a model's numbers and on the server's patience, against a real `tinkerrpc serve` (its own, with
--backend-timeout 8, because one test stops its engine child):
- values that used to poison a model (logprobs -1e30, eps 0, learning rate or weight decay 1e30,
  temperature 1e-40) are refused INVALID_ARGUMENT naming the field;
- a step that goes non-finite although every field is in range (sampler logprobs of -1e4, allowed, make
  the importance ratios exp(logp + 1e4) overflow float32) fails FAILED_PRECONDITION NON_FINITE_UPDATE and
  changes nothing: version, checkpoints, weights (prompt logprobs of a probe) and optimizer state (the next
  step equals that of a twin model that never saw the poisoned call), and the model trains right after;
- a Train against an engine that stopped answering (SIGSTOP) ends DEADLINE_EXCEEDED at its deadline, or at
  --backend-timeout when it has none, and once the engine answers again the model trains normally."""

from __future__ import annotations

import math
import os
import signal
import time
from collections.abc import Iterator

import grpc
import pytest
from service.svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    error_info,
    prompt_logprobs,
    rl_request,
    sample_chat,
    violated_fields,
)

from tinkerrpc import RPCError, raise_for_rpc_error
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc.v1.errors_pb2 import ErrorReason

pytestmark = pytest.mark.process

BACKEND_TIMEOUT = 8
POISONED, TWIN, STUCK = "poisoned", "poisoned-twin", "stuck"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("poison")
    server = Server(
        tmp / "data", tmp / "models", tmp / "serve.log", None, "--backend-timeout", str(BACKEND_TIMEOUT)
    )
    yield server
    assert server.close() == 0, server.proc.log()[-3000:]


def _state(server: Server, model: str, probe: list[int]) -> dict[str, object]:
    info = server.stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT).model
    checkpoints = server.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=model), timeout=CALL_TIMEOUT)
    return {
        "version": info.policy_version,
        "sampleable": list(info.sampleable_versions),
        "checkpoints": sorted((c.kind, c.name, c.tinker_path) for c in checkpoints.checkpoints),
        "weights": prompt_logprobs(server.stub, model, probe),
    }


def _train_error(
    server: Server, request: pb.TrainRequest, timeout: float | None = CALL_TIMEOUT
) -> grpc.RpcError:
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Train(request, timeout=timeout)
    return raised.value


def test_values_that_poisoned_a_model_are_refused_naming_the_field(server: Server) -> None:
    create_model(server.stub, "refuser")
    sample = sample_chat(server.stub, "refuser", "say yes", n=2)
    probe = list(sample.prompt_token_ids)
    before = _state(server, "refuser", probe)

    def train_with(field: str, value: float) -> pb.TrainRequest:
        request = rl_request("refuser", sample, [1.0, 0.0])
        if field == "completion_logprobs":
            turn = request.groups[0].trajectories[0].turns[0]
            turn.completion_logprobs[:] = [value] * len(turn.completion_logprobs)
        else:
            setattr(request.adam, field, value)
        return request

    cases = {
        "groups[0].trajectories[0].turns[0].completion_logprobs": train_with("completion_logprobs", -1e30),
        "adam.eps": train_with("eps", 0.0),
        "adam.learning_rate": train_with("learning_rate", 1e30),
        "adam.weight_decay": train_with("weight_decay", 1e30),
    }
    for field, request in cases.items():
        assert violated_fields(_train_error(server, request)) == [field]

    tiny_temperature = pb.SampleRequest(
        model="refuser",
        tokens=pb.TokenPrompt(token_ids=probe),
        params=types_pb2.SamplingParams(max_tokens=2, temperature=1e-40),
    )
    with pytest.raises(grpc.RpcError) as raised:
        server.stub.Sample(tiny_temperature, timeout=CALL_TIMEOUT)
    assert violated_fields(raised.value) == ["params.temperature"]
    assert _state(server, "refuser", probe) == before


def test_a_step_that_overflows_is_not_committed_and_the_model_trains_on(server: Server) -> None:
    for model in (POISONED, TWIN):
        create_model(server.stub, model)  # the same seed: the same initial adapter
    sample = sample_chat(server.stub, POISONED, "count to three", n=4, max_tokens=6)
    probe = list(sample.prompt_token_ids)
    rewards = [1.0, 0.0, 0.5, 0.25]

    def step(model: str, rewards: list[float] = rewards) -> pb.TrainResponse:
        request = rl_request(model, sample, rewards)
        response: pb.TrainResponse = server.stub.Train(request, timeout=CALL_TIMEOUT)
        return response

    # One ordinary step each first, so both have AdamW moments the poisoned call could have touched.
    assert [step(model).policy_version for model in (POISONED, TWIN)] == [1, 1]
    before = _state(server, POISONED, probe)

    # In range (sampler logprobs >= -1e4), yet exp(logp - q) overflows float32: only the step can tell.
    poisoned = rl_request(POISONED, sample, rewards)
    for trajectory in poisoned.groups[0].trajectories:
        for turn in trajectory.turns:
            turn.completion_logprobs[:] = [-1e4] * len(turn.completion_logprobs)
    err = _train_error(server, poisoned)
    assert err.code() == grpc.StatusCode.FAILED_PRECONDITION, err.details()
    assert error_info(err).reason == "NON_FINITE_UPDATE"
    assert "was not applied" in (err.details() or "")
    with pytest.raises(RPCError) as typed:
        raise_for_rpc_error(err)
    assert typed.value.reason == ErrorReason.ERROR_REASON_NON_FINITE_UPDATE

    assert _state(server, POISONED, probe) == before
    # The optimizer state is unchanged too: the next step lands exactly where the twin's does.
    other_rewards = [0.0, 1.0, 0.25, 0.5]
    after_poison, twin = step(POISONED, other_rewards), step(TWIN, other_rewards)
    assert after_poison.policy_version == twin.policy_version == 2
    assert after_poison.metrics.loss == twin.metrics.loss
    assert prompt_logprobs(server.stub, POISONED, probe) == prompt_logprobs(server.stub, TWIN, probe)
    assert math.isfinite(after_poison.metrics.loss)


def test_a_train_on_a_backend_that_never_answers_ends_at_its_deadline(server: Server) -> None:
    create_model(server.stub, STUCK)
    sample = sample_chat(server.stub, STUCK, "hello", n=2)
    probe = list(sample.prompt_token_ids)
    request = rl_request(STUCK, sample, [1.0, 0.0])
    before = _state(server, STUCK, probe)
    engine = server.engine_pid()

    os.kill(engine, signal.SIGSTOP)
    try:
        # With a deadline: DEADLINE_EXCEEDED at it, and the model's lock is free again.
        started = time.monotonic()
        err = _train_error(server, request, timeout=4)
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert time.monotonic() - started < 4 + 2
        # Without one: the server's own bound (--backend-timeout) answers, naming what it waited for.
        started = time.monotonic()
        err = _train_error(server, request, timeout=None)
        waited = time.monotonic() - started
        assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err.details()
        assert "backend did not finish" in (err.details() or ""), err.details()
        assert BACKEND_TIMEOUT - 1 < waited < BACKEND_TIMEOUT + 5
    finally:
        os.kill(engine, signal.SIGCONT)

    # Nothing was committed, and the model trains as soon as the engine answers.
    assert _state(server, STUCK, probe) == before
    response = server.stub.Train(request, timeout=CALL_TIMEOUT)
    assert response.policy_version == before["version"] + 1  # type: ignore[operator]
