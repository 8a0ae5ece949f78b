"""Samples racing what discards their version: a pinned Sample whose version a RestoreCheckpoint or a
DeleteModel discards while it runs either answers or fails NOT_FOUND naming the version, never INTERNAL or
INVALID_ARGUMENT, and neither the server nor its engine logs a traceback for it. Each race starts several
Samples, then discards their version at once, a bounded number of times, so some land before, during and
after the discard."""

from __future__ import annotations

import grpc
import pytest
from svc import CALL_TIMEOUT, Server, assistant, create_model, user

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

RACES = 4
SAMPLES_PER_RACE = 4


def _train(server: Server, model: str) -> int:
    request = pb.TrainRequest(model=model, adam=types_pb2.AdamParams(learning_rate=1e-3))
    request.examples.add(messages=[user("respond with yes"), assistant("yes")])
    return server.stub.Train(request, timeout=CALL_TIMEOUT).policy_version


def _start_samples(server: Server, model: str, version: int) -> list[grpc.CallFuture[pb.SampleResponse]]:
    calls = []
    for seed in range(SAMPLES_PER_RACE):
        params = types_pb2.SamplingParams(n=1, max_tokens=8, seed=seed)
        request = pb.SampleRequest(
            model=model, chat=pb.ChatPrompt(messages=[user("hi")]), params=params, policy_version=version
        )
        calls.append(server.stub.Sample.future(request, timeout=CALL_TIMEOUT))
    return calls


def _answered_or_not_found(
    calls: list[grpc.CallFuture[pb.SampleResponse]], model: str, version: int, gone: str
) -> None:
    """Each call answered at `version`, or NOT_FOUND naming the model and `gone` (what was discarded)."""
    for call in calls:
        try:
            assert call.result().policy_version == version
        except grpc.RpcError as err:
            details = err.details() or ""
            assert err.code() == grpc.StatusCode.NOT_FOUND, (err.code(), details)
            assert repr(model) in details and gone in details, details


def _no_traceback(server: Server) -> None:
    assert "Traceback" not in server.proc.log(), server.proc.log()[-3000:]


def test_samples_racing_a_restore_answer_or_are_not_found(server: Server) -> None:
    model = "raced-by-restore"
    create_model(server.stub, model, rank=1)
    _train(server, model)
    server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=model, name="one"), timeout=CALL_TIMEOUT)
    for _ in range(RACES):
        version = _train(server, model)
        calls = _start_samples(server, model, version)
        server.stub.RestoreCheckpoint(
            pb.RestoreCheckpointRequest(model=model, checkpoint="one"), timeout=CALL_TIMEOUT
        )
        _answered_or_not_found(calls, model, version, f"version {version}")
    server.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)
    _no_traceback(server)


def test_samples_racing_delete_model_answer_or_are_not_found(server: Server) -> None:
    for race in range(RACES):
        model = f"raced-by-delete-{race}"
        create_model(server.stub, model, rank=1)
        calls = _start_samples(server, model, 0)
        server.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)
        # A Sample that starts after the delete finds no model; one that was running, no version.
        _answered_or_not_found(calls, model, 0, "")
    _no_traceback(server)
