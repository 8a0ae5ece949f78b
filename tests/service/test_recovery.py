"""Restart recovery: the server dies abruptly (os._exit(137) at a point inside Train, which is what SIGKILL
does; crashing_server.py builds the real server with that step hook) and restarts on the same data dir.
Every model must come back at its last committed version, sampleable, with matching weights, and the next
Train must work."""

from __future__ import annotations

import os
import select
from pathlib import Path

import grpc
import pytest
from svc import CALL_TIMEOUT, Server, create_model, prompt_logprobs, rl_request, sample_chat

from tinkerrpc.v1 import trainer_service_pb2 as pb

pytestmark = pytest.mark.process

MODEL = "crashy"


def _wait_gone(pid: int, timeout: float = 30.0) -> bool:
    """Whether process `pid` (the server's child, not ours) ends within `timeout`: its pidfd turns
    readable as it exits, before any reaper collects it."""
    try:
        pidfd = os.pidfd_open(pid)
    except ProcessLookupError:
        return True
    try:
        readable, _, _ = select.select([pidfd], [], [], timeout)
        return bool(readable)
    finally:
        os.close(pidfd)


def _start(tmp: Path, model_dir: Path, tag: str, crash_at: str = "") -> Server:
    return Server(tmp / "data", model_dir, tmp / f"serve-{tag}.log", crash_at=crash_at)


def _train_request(server: Server, key: str) -> pb.TrainRequest:
    sample = sample_chat(server.stub, MODEL, "respond with no", n=2, max_tokens=3, seed=len(key))
    return rl_request(MODEL, sample, [1.0, 0.0], idempotency_key=key)


def test_crash_at_every_step_phase_restarts_consistent(tmp_path: Path, service_model_dir: Path) -> None:
    server = _start(tmp_path, service_model_dir, "first")
    create_model(server.stub, MODEL)
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    assert server.stub.Train(_train_request(server, "k1"), timeout=CALL_TIMEOUT).policy_version == 1
    committed = prompt_logprobs(server.stub, MODEL, probe)
    assert server.close() == 0

    # Crashes before the commit (after the optimizer step; after the new sampler weights were saved;
    # after everything was saved): the step never happened.
    for point in ("after_optim", "after_sampler_save", "before_commit"):
        server = _start(tmp_path, service_model_dir, point, crash_at=point)
        engine = server.engine_pid()
        model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
        assert model.policy_version == 1 and list(model.sampleable_versions) == [0, 1], point
        assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(committed, abs=1e-5), point
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Train(_train_request(server, f"k-{point}"), timeout=CALL_TIMEOUT)
        assert err.value.code() == grpc.StatusCode.UNAVAILABLE, point
        assert server.proc.wait(30) == 137
        server.close()
        assert _wait_gone(engine), f"the engine child outlived its server ({point})"

    # A crash after the commit: the step happened, and its retry is answered from the record.
    server = _start(tmp_path, service_model_dir, "after_commit", crash_at="after_commit")
    retried = _train_request(server, "k2")
    with pytest.raises(grpc.RpcError):
        server.stub.Train(retried, timeout=CALL_TIMEOUT)
    server.proc.wait(30)
    server.close()

    server = _start(tmp_path, service_model_dir, "last")
    try:
        model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
        assert model.policy_version == 2 and list(model.sampleable_versions) == [0, 1, 2]
        at_two = prompt_logprobs(server.stub, MODEL, probe)
        assert at_two != pytest.approx(committed, abs=1e-6)
        assert prompt_logprobs(server.stub, MODEL, probe, version=1) == pytest.approx(committed, abs=1e-5)
        replay = server.stub.Train(retried, timeout=CALL_TIMEOUT)
        assert replay.replayed and replay.policy_version == 2
        assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(at_two, abs=1e-6)
        # Training resumes from the recovered state (weights and optimizer).
        assert server.stub.Train(_train_request(server, "k3"), timeout=CALL_TIMEOUT).policy_version == 3
    finally:
        assert server.close() == 0


def test_checkpoint_every_k_keeps_the_versions_after_the_last_state_checkpoint(
    tmp_path: Path, service_model_dir: Path
) -> None:
    server = Server(
        tmp_path / "data", service_model_dir, tmp_path / "serve.log", None, "--checkpoint-every", "2"
    )
    create_model(server.stub, MODEL)
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    requests, responses = [], []
    for i in range(3):
        requests.append(_train_request(server, f"s{i}"))
        responses.append(server.stub.Train(requests[-1], timeout=CALL_TIMEOUT))
    assert [r.policy_version for r in responses] == [1, 2, 3]
    assert [r.HasField("state_checkpoint") for r in responses] == [False, True, False]
    at_three = prompt_logprobs(server.stub, MODEL, probe)
    # An earlier version exports from its own state checkpoint, whether or not the current one has one.
    exported = list(
        server.stub.ExportWeights(
            pb.ExportWeightsRequest(model=MODEL, policy_version=2), timeout=CALL_TIMEOUT
        )
    )
    assert exported[0].weights.policy_version == 2
    assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(at_three, abs=1e-6)
    with pytest.raises(grpc.RpcError) as err:
        list(
            server.stub.ExportWeights(
                pb.ExportWeightsRequest(model=MODEL, policy_version=1), timeout=CALL_TIMEOUT
            )
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND, "version 1 has no state checkpoint to export from"
    server.proc.kill()
    server.close()

    server = Server(
        tmp_path / "data", service_model_dir, tmp_path / "again.log", None, "--checkpoint-every", "2"
    )
    try:
        # Version 3 is rebuilt from step_000002 and its step record.
        model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
        assert model.policy_version == 3 and list(model.sampleable_versions) == [0, 1, 2, 3]
        assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(at_three, abs=1e-5)
        replay = server.stub.Train(requests[2], timeout=CALL_TIMEOUT)
        assert replay.replayed and replay.policy_version == 3
        assert server.stub.Train(_train_request(server, "s9"), timeout=CALL_TIMEOUT).policy_version == 4
    finally:
        assert server.close() == 0
