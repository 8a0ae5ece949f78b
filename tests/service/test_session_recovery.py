"""A Tinker session the backend finishes is replaced (issue 40 item 2). serve keeps everything it makes on
the backend in one session; the backend finishes it when someone holding its key calls the finish-session
route, or when serve sends nothing for the session timeout (here: serve SIGSTOPped past an 11 s timeout).
serve then opens a new session and re-creates its clients; meanwhile calls are answered UNAVAILABLE
(retryable), never INVALID_ARGUMENT, and gRPC health says NOT_SERVING until the new session is open.

The backend is a separately started `tinkerrpc engine` with a short session timeout, used as serve uses
Tinker itself (--tinker-url and its key), so the test holds the key that finishes sessions
(session_support.py)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from session_support import SESSION_TIMEOUT, finish_session, sessions, until_served
from svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    poll_until,
    prompt_logprobs,
    sample_chat,
    yes_no_sft_request,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

MODEL = "sessions"
SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("session-engine")
    with LocalEngine(
        tmp / "data",
        service_model_dir,
        tmp / "engine.log",
        startup_timeout=240,
        session_timeout=SESSION_TIMEOUT,
    ) as running:
        yield running


@pytest.fixture(scope="module")
def server(
    tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path, engine: LocalEngine
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("session-serve")
    env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
    running = Server(tmp / "data", service_model_dir, tmp / "serve.log", env, "--tinker-url", engine.base_url)
    create_model(running.stub, MODEL)
    running.stub.Train(yes_no_sft_request(MODEL, 1e-2), timeout=CALL_TIMEOUT)
    yield running
    assert running.close() == 0, running.proc.log()[-3000:]


class HealthWatch:
    """Every status gRPC health's Watch stream reports for the server, from now on."""

    def __init__(self, server: Server) -> None:
        self.statuses: list[int] = []
        self._stream = health_pb2_grpc.HealthStub(server.channel).Watch(health_pb2.HealthCheckRequest())
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()
        assert poll_until(lambda: bool(self.statuses), 10), "health's Watch sends the status at once"

    def _read(self) -> None:
        try:
            for response in self._stream:
                self.statuses.append(response.status)
        except grpc.RpcError:
            pass  # cancelled by close()

    def close(self) -> None:
        self._stream.cancel()
        self._reader.join(10)


def _serves_again(server: Server, engine: LocalEngine, opened_before: int) -> int:
    """After a lost session: every kind of call succeeds (each failing only UNAVAILABLE meanwhile), a new
    session is open, and the model trains on from the version it was at (returned)."""
    at_version = server.stub.GetModel(
        pb.GetModelRequest(name=MODEL), timeout=CALL_TIMEOUT
    ).model.policy_version
    sampled, _ = until_served(lambda: sample_chat(server.stub, MODEL, "respond with yes", n=2), "Sample")
    assert len(sampled.sequences) == 2 and sampled.policy_version == at_version
    trained, _ = until_served(
        lambda: server.stub.Train(yes_no_sft_request(MODEL, 1e-2), timeout=CALL_TIMEOUT), "Train"
    )
    assert trained.policy_version == at_version + 1, "nothing committed was lost, nothing applied twice"
    made, _ = until_served(lambda: create_model(server.stub, f"{MODEL}-{at_version}"), "CreateModel")
    assert made.policy_version == 0
    assert len(sessions(engine)) == opened_before + 1, "one new session, not one per call"
    assert "the Tinker backend finished this server's session; opening a new one" in server.proc.log()
    check = health_pb2_grpc.HealthStub(server.channel).Check(health_pb2.HealthCheckRequest(), timeout=10)
    assert check.status == SERVING
    return at_version


def test_a_session_finished_by_its_route_is_replaced_and_calls_are_answered_unavailable(
    server: Server, engine: LocalEngine
) -> None:
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    before = prompt_logprobs(server.stub, MODEL, probe)
    opened = sessions(engine)
    health = HealthWatch(server)
    try:
        finish_session(engine, opened[-1])
        at_version = _serves_again(server, engine, len(opened))
        assert poll_until(lambda: health.statuses[-1:] == [SERVING] and NOT_SERVING in health.statuses, 10)
        assert health.statuses[0] == SERVING and NOT_SERVING in health.statuses, health.statuses
    finally:
        health.close()
    # The version it was at has the same weights: the new session's sampler reads the same files.
    assert prompt_logprobs(server.stub, MODEL, probe, version=at_version) == pytest.approx(before, abs=1e-6)


def test_a_session_that_timed_out_while_serve_was_stopped_is_replaced(
    server: Server, engine: LocalEngine
) -> None:
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    before = prompt_logprobs(server.stub, MODEL, probe)
    opened = sessions(engine)
    os.kill(server.proc.pid, signal.SIGSTOP)
    try:
        timed_out = poll_until(lambda: f"session {opened[-1]} sent nothing for" in engine.log(), 60, 0.5)
    finally:
        os.kill(server.proc.pid, signal.SIGCONT)
    assert timed_out, "the engine finishes a session silent for its timeout"
    at_version = _serves_again(server, engine, len(opened))
    assert prompt_logprobs(server.stub, MODEL, probe, version=at_version) == pytest.approx(before, abs=1e-6)


def test_nothing_made_after_the_session_finished_stays_on_the_engine(
    server: Server, engine: LocalEngine
) -> None:
    """A restore right after the session finished makes a training client: not in the finished session
    (the engine refuses a finished session's load_weights as its create_model; serve also finishes the
    old session again when it lets its clients go), so nothing is left on the engine."""
    server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="mark"), timeout=CALL_TIMEOUT)
    finished = sessions(engine)[-1]
    finish_session(engine, finished)
    restored, _ = until_served(
        lambda: server.stub.RestoreCheckpoint(
            pb.RestoreCheckpointRequest(model=MODEL, checkpoint="mark"), timeout=CALL_TIMEOUT
        ),
        "RestoreCheckpoint",
    )
    assert poll_until(lambda: sessions(engine)[-1] != finished, 30), "serve opens a new session"
    # The new session's training client goes with it; then no model is left on the engine.
    opened = len(sessions(engine))
    finish_session(engine, sessions(engine)[-1])
    assert poll_until(lambda: len(sessions(engine)) > opened, 30)
    assert poll_until(lambda: engine.stats()["live_models"] == 0, 30), engine.stats()
    assert server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model.policy_version == (
        restored.model.policy_version
    )
