"""Slow and departed clients cannot starve the server (issue 16, item 5), against real processes.

HTTP: half-sent requests to the hosted sidecar are closed by the server within its header timeout while
normal requests still succeed, and connections beyond one client's share are answered 503 and closed at
once while gRPC keeps answering; a local user of another uid holds no slot of the engine and one share
of the sidecar while the server's own Sample and Train and the sidecar's other clients are served. Engine: a sample whose caller gave up is dropped instead of run, and a Train of
another model queued behind a long sample completes before that sample does (order, not timings)."""

from __future__ import annotations

import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from hardening_support import SIDECAR_KEY, HostedServer
from other_uid_connections import HALF_REQUEST, closed_by_server
from service.svc import CALL_TIMEOUT, TINY, Server, create_model, rl_request, sample_chat

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.processes.http_serving import HEADER_READ_TIMEOUT_SECONDS, SHARED

pytestmark = pytest.mark.process

# The local user the attacks come from: uid 65534, "nobody" on Debian.
NOBODY = 65534
# How long past the header timeout a half-sent connection may stay open (a loaded 2-core machine).
CLOSE_SLACK_SECONDS = 15.0


def _half_sent(url: str, count: int) -> list[socket.socket]:
    host, port = url.removeprefix("http://").split(":")
    sockets = []
    for _ in range(count):
        sock = socket.create_connection((host, int(port)), timeout=10)
        sock.sendall(HALF_REQUEST)
        sockets.append(sock)
    return sockets


def _models(url: str) -> int:
    request = urllib.request.Request(f"{url}/v1/models", headers={"Authorization": f"Bearer {SIDECAR_KEY}"})
    with urllib.request.urlopen(request, timeout=30) as response:
        return int(response.status)


def test_half_sent_headers_are_closed_within_the_timeout(hosted_server: HostedServer) -> None:
    slow = _half_sent(hosted_server.sidecar_url, 60)
    try:
        assert _models(hosted_server.sidecar_url) == 200
        deadline = time.monotonic() + HEADER_READ_TIMEOUT_SECONDS + CLOSE_SLACK_SECONDS
        still_open = [sock for sock in slow if closed_by_server(sock, deadline) is None]
        assert not still_open, f"{len(still_open)} of {len(slow)} half-sent connections still open"
        assert _models(hosted_server.sidecar_url) == 200
    finally:
        for sock in slow:
            sock.close()


def test_one_client_holds_at_most_its_share_while_grpc_answers(hosted_server: HostedServer) -> None:
    server = hosted_server.server
    create_model(server.stub, "slow-clients")
    share = SHARED.per_peer
    slow = _half_sent(hosted_server.sidecar_url, share + 20)
    try:
        # The server closes the newest ones at once (beyond one client's share), with a 503.
        soon = time.monotonic() + 5
        refused = [reply for sock in slow[-20:] if (reply := closed_by_server(sock, soon)) is not None]
        assert len(refused) == 20, f"only {len(refused)} of the 20 connections beyond the share were refused"
        assert all(reply.startswith(b"HTTP/1.1 503") for reply in refused)
        assert all(b"too many connections from this client" in reply for reply in refused)
        # gRPC is another server: Sample and Train still answer while the sidecar is at its cap.
        sample = sample_chat(server.stub, "slow-clients", "respond with yes", n=2, max_tokens=4, seed=3)
        trained = server.stub.Train(rl_request("slow-clients", sample, [1.0, 0.0]), timeout=CALL_TIMEOUT)
        assert trained.policy_version == 1
        # The capped connections are still closed by the header timeout, and the sidecar serves again.
        deadline = time.monotonic() + HEADER_READ_TIMEOUT_SECONDS + CLOSE_SLACK_SECONDS
        still_open = [sock for sock in slow[:-20] if closed_by_server(sock, deadline) is None]
        assert not still_open, f"{len(still_open)} capped connections still open"
        assert _models(hosted_server.sidecar_url) == 200
    finally:
        for sock in slow:
            sock.close()


def _sample_and_train(server: Server, model: str, timeout: float) -> float:
    """Seconds for one Sample and one Train on its samples, each under `timeout`."""
    started = time.monotonic()
    sample = sample_chat(server.stub, model, "respond with yes", n=2, max_tokens=4, seed=3)
    server.stub.Train(rl_request(model, sample, [1.0, 0.0]), timeout=timeout)
    return time.monotonic() - started


@pytest.mark.skipif(os.getuid() != 0, reason="acting as another local user needs root (CI runs as root)")
def test_another_uid_holds_no_engine_slot_and_one_share_of_the_sidecar(hosted_server: HostedServer) -> None:
    server = hosted_server.server
    create_model(server.stub, "other-uid")
    before = statistics.median(_sample_and_train(server, "other-uid", CALL_TIMEOUT) for _ in range(3))
    engine_url, sidecar_url = server.engine_url(), hosted_server.sidecar_url
    attack = 300
    attacker = subprocess.Popen(
        [
            sys.executable,
            str(Path(__file__).with_name("other_uid_connections.py")),
            "--uid",
            str(NOBODY),
            "--count",
            str(attack),
            engine_url,
            sidecar_url,
        ],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert attacker.stdout is not None
        report = json.loads(attacker.stdout.readline())
        # The engine answers a local user of another uid at once, before its headers' deadline.
        assert report[engine_url] == {"closed": attack, "status_lines": ["HTTP/1.1 403 Forbidden"]}
        # The sidecar keeps one client's share for it and refuses the rest.
        assert report[sidecar_url]["closed"] == attack - SHARED.per_peer
        assert report[sidecar_url]["status_lines"] == ["HTTP/1.1 503 Service Unavailable"]
        # Meanwhile the server's own calls and the sidecar's other clients are served as before.
        during = [_sample_and_train(server, "other-uid", 2 * before + 2.0) for _ in range(3)]
        print(f"Sample+Train {before:.2f} s before, {statistics.median(during):.2f} s during the attack")
        assert _models(sidecar_url) == 200
    finally:
        attacker.communicate(timeout=30)


LONG_SAMPLE_ROWS = 64


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work: Path = tmp_path_factory.mktemp("slow-engine")
    with LocalEngine(work / "data", work / "models", work / "engine.log") as running:
        yield running


def test_abandoned_sample_is_dropped_and_train_runs_between_decode_steps(engine: LocalEngine) -> None:
    with engine.service_client() as service:
        trainer = service.create_lora_training_client(TINY, rank=8).result()
        sampler = service.create_sampling_client(base_model=TINY).result()
        # Other weights: a request for them cannot join the long sample's running batch, so it queues.
        other_sampler = trainer.save_weights_and_get_sampling_client().result()
        prompt = tinker.types.ModelInput.from_ints([5, 6, 7, 8])
        before = engine.stats()
        # A long sample (sampling until the context is full, 64 rows: ~6 s here, where 8 rows now take
        # ~1.2 s, less than the two pauses below) keeps the compute thread busy...
        long_sample = sampler.sample(
            prompt,
            num_samples=LONG_SAMPLE_ROWS,
            sampling_params=tinker.types.SamplingParams(max_tokens=1500, seed=1, stop=[]),
        ).future()
        time.sleep(1.0)
        # ...a sample queued behind it whose caller gives up (its SDK call is cancelled)...
        given_up = other_sampler.sample(
            prompt, num_samples=1, sampling_params=tinker.types.SamplingParams(max_tokens=8, seed=2)
        ).future()
        time.sleep(1.0)
        assert given_up.cancel()
        # ...and a training step of another model, which must not wait for the long sample.
        datum = tinker.types.Datum(
            model_input=tinker.types.ModelInput.from_ints([5, 6, 7]),
            loss_fn_inputs={"target_tokens": [6, 7, 8], "weights": [1.0, 1.0, 1.0]},
        )
        trainer.forward_backward([datum], "cross_entropy").result(timeout=120)
        trainer.optim_step(tinker.types.AdamParams(learning_rate=1e-4)).result(timeout=120)
        assert not long_sample.done(), "the Train finished only after the long sample"
        assert len(long_sample.result(timeout=120).sequences) == LONG_SAMPLE_ROWS
        deadline = time.monotonic() + 30
        while engine.stats()["abandoned_sample_requests"] == before["abandoned_sample_requests"]:
            assert time.monotonic() < deadline, "the abandoned sample was never dropped"
            time.sleep(0.2)
        after = engine.stats()
    assert after["abandoned_sample_requests"] - before["abandoned_sample_requests"] == 1
    # Only the long sample ran: the abandoned one was dropped before it started.
    assert after["sample_requests"] - before["sample_requests"] == 1
    assert after["training_ops_between_decode_steps"] - before["training_ops_between_decode_steps"] >= 2
