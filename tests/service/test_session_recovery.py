"""A Tinker session the backend finishes is replaced (issue 40 item 2). serve keeps everything it makes on
the backend in one session; the backend finishes it when someone holding its key calls the finish-session
route, or when serve sends nothing for the session timeout (here: serve SIGSTOPped past an 11 s timeout).
serve then opens a new session and re-creates its clients; meanwhile calls are answered UNAVAILABLE
(retryable), never INVALID_ARGUMENT, and gRPC health says NOT_SERVING until the new session is open.

The backend is a separately started `tinkerrpc engine` with a short session timeout, used as serve uses
Tinker itself (--tinker-url and its key), so the test holds the key that finishes sessions."""

from __future__ import annotations

import os
import re
import signal
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
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
# The engine's shortest session timeout (the CLI takes more than the SDK's 10 s heartbeat).
SESSION_TIMEOUT = 11.0
# How long serve may take to notice a finished session and open a new one: its check runs every 5 s.
RECOVERY_SECONDS = 30.0
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


def sessions(engine: LocalEngine) -> list[str]:
    """The sessions the engine opened, in order (its log names each)."""
    return re.findall(r"session (s[0-9a-f]+) created", engine.log())


def finish_session(engine: LocalEngine, session: str) -> None:
    """What anyone holding the engine's key can do: the Tinker API's finish-session route."""
    request = urllib.request.Request(
        f"{engine.base_url}/api/v1/sessions/{session}/finish", data=b"", headers=engine.auth_headers
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


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


def until_served(call: Callable[[], Any], what: str) -> tuple[Any, list[grpc.StatusCode]]:
    """`call`'s answer once it succeeds (within RECOVERY_SECONDS), and the codes it failed with before;
    every failure must be UNAVAILABLE: the session is the server's problem, never the caller's."""
    failures: list[grpc.StatusCode] = []
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        try:
            return call(), failures
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, f"{what}: {err.code()}: {err.details()}"
            assert "retry" in (err.details() or ""), err.details()
            failures.append(err.code())
        assert time.monotonic() < deadline, f"{what} still failing after {RECOVERY_SECONDS} s: {failures}"
        time.sleep(0.2)


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
