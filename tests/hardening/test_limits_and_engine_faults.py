"""Limits, deadlines and engine supervision of `tinkerrpc serve`, on the shared hosted server (conftest: small
limits, 1 MiB messages; the over-size message row is in the bad-input campaign). The engine-crash test runs
last in this module: it SIGKILLs the server's engine child."""

from __future__ import annotations

import os
import re
import signal
import threading
import time

import grpc
import pytest
from google.rpc import error_details_pb2
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hardening_support import (
    MAX_SAMPLE_N,
    MAX_SAMPLE_TOKENS,
    MAX_TRAIN_TOKENS,
    MAX_TRAIN_TRAJECTORIES,
    HostedServer,
)
from service.svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    error_details,
    poll_until,
    prompt_logprobs,
    rl_request,
    sample_chat,
    violated_fields,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

MODEL = "limited"
SERVICE = "tinkerrpc.v1.TrainerService"


@pytest.fixture(scope="module")
def server(hosted_server: HostedServer) -> Server:
    create_model(hosted_server.server.stub, MODEL)
    return hosted_server.server


def _version(server: Server, model: str = MODEL) -> int:
    return server.stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT).model.policy_version


def _probe_tokens(server: Server) -> list[int]:
    return list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)


def _group_request(server: Server, model: str, trajectories: int, prompt_tokens: int = 0) -> pb.TrainRequest:
    """One group of `trajectories` sampled completions; with `prompt_tokens`, each prompt is replaced by
    that many tokens (a bigger step)."""
    sample = sample_chat(server.stub, model, "respond with yes", n=2, max_tokens=4, seed=3)
    request = rl_request(model, sample, [1.0, 0.0])
    group = request.groups[0]
    while len(group.trajectories) < trajectories:
        group.trajectories.add().CopyFrom(group.trajectories[len(group.trajectories) % 2])
    if prompt_tokens:
        for trajectory in group.trajectories:
            del trajectory.turns[0].prompt_token_ids[:]
            trajectory.turns[0].prompt_token_ids.extend([5] * prompt_tokens)
    return request


def test_sample_limits_name_field_and_flag(server: Server) -> None:
    def refused(params: types_pb2.SamplingParams, tokens: list[int] | None = None) -> grpc.RpcError:
        request = pb.SampleRequest(model=MODEL, params=params)
        if tokens is None:
            request.text = "hello"
        else:
            request.tokens.token_ids.extend(tokens)
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Sample(request, timeout=CALL_TIMEOUT)
        return err.value

    too_many = refused(types_pb2.SamplingParams(n=MAX_SAMPLE_N + 1, max_tokens=1))
    assert violated_fields(too_many) == ["params.n"]
    assert "--max-sample-n" in too_many.details() and str(MAX_SAMPLE_N) in too_many.details()

    too_long = refused(types_pb2.SamplingParams(max_tokens=MAX_SAMPLE_TOKENS + 1))
    assert violated_fields(too_long) == ["params.max_tokens"]
    assert "--max-sample-tokens" in too_long.details()

    context = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model.max_context_length
    over_context = refused(types_pb2.SamplingParams(max_tokens=MAX_SAMPLE_TOKENS), [5] * (context - 10))
    assert violated_fields(over_context) == ["params.max_tokens"]
    assert f"exceed the context of {context}" in over_context.details()

    full_prompt = refused(types_pb2.SamplingParams(max_tokens=1), [5] * context)
    assert "prompt" in violated_fields(full_prompt)

    # At the limits exactly, sampling works.
    ok = sample_chat(server.stub, MODEL, "hi", n=MAX_SAMPLE_N, max_tokens=MAX_SAMPLE_TOKENS)
    assert len(ok.sequences) == MAX_SAMPLE_N


def test_train_size_limits_are_resource_exhausted_and_change_nothing(server: Server) -> None:
    before = _version(server)
    too_many = _group_request(server, MODEL, MAX_TRAIN_TRAJECTORIES + 1)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Train(too_many, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-train-trajectories" in err.value.details()
    quota = [d for d in error_details(err.value) if isinstance(d, error_details_pb2.QuotaFailure)]
    assert quota and quota[0].violations[0].subject == "--max-train-trajectories"

    # Few trajectories, long prompts: over the token limit.
    too_long = _group_request(server, MODEL, 4, prompt_tokens=1000)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Train(too_long, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
    assert "--max-train-tokens" in err.value.details() and str(MAX_TRAIN_TOKENS) in err.value.details()
    assert _version(server) == before

    within = _group_request(server, MODEL, MAX_TRAIN_TRAJECTORIES)
    assert server.stub.Train(within, timeout=CALL_TIMEOUT).policy_version == before + 1


def test_sample_with_short_deadline_is_deadline_exceeded(server: Server) -> None:
    request = pb.SampleRequest(
        model=MODEL, text="tell me", params=types_pb2.SamplingParams(n=MAX_SAMPLE_N, max_tokens=64)
    )
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Sample(request, timeout=0.001)
    assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len(sample_chat(server.stub, MODEL, "tell me", n=2).sequences) == 2


def test_train_cut_by_its_deadline_leaves_no_trace(server: Server) -> None:
    """Twin models (same seed, same weights): `steady` trains step R once; `cut` first gets R with a
    deadline that expires mid-step, then R again. Same version and same weights afterwards prove the cut
    step left nothing behind, optimizer state included."""
    steady, cut = "twin-steady", "twin-cut"
    create_model(server.stub, steady)
    create_model(server.stub, cut)
    probe = _probe_tokens(server)
    assert prompt_logprobs(server.stub, steady, probe) == prompt_logprobs(server.stub, cut, probe)
    step = _group_request(server, steady, MAX_TRAIN_TRAJECTORIES, prompt_tokens=150)
    started = time.monotonic()
    assert server.stub.Train(step, timeout=CALL_TIMEOUT).policy_version == 1
    step_seconds = time.monotonic() - started

    step.model = cut
    cancelled_log = "Train cancelled mid-step"
    seen = server.proc.log().count(cancelled_log)
    # A fraction of a whole step lands inside it; bounded attempts in case one expires before it starts.
    for fraction in (0.3, 0.5, 0.7):
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Train(step, timeout=step_seconds * fraction)
        assert err.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        # The server's handler sees the cancellation a moment after the client does.
        if poll_until(lambda: server.proc.log().count(cancelled_log) > seen, 1.0):
            break
    assert server.proc.log().count(cancelled_log) > seen, "a deadline expired in the middle of a step"
    assert _version(server, cut) == 0
    assert server.stub.Train(step, timeout=CALL_TIMEOUT).policy_version == 1
    assert prompt_logprobs(server.stub, cut, probe) == pytest.approx(
        prompt_logprobs(server.stub, steady, probe), abs=1e-5
    )


def _engine_pids(server: Server) -> list[int]:
    return [int(pid) for pid in re.findall(r"embedded engine starting \(pid (\d+)\)", server.proc.log())]


def _health_statuses(health: health_pb2_grpc.HealthStub, seconds: float) -> dict[str, list[int]]:
    """The distinct statuses health checking reports for the server ("") and the service, each watched
    (both streams open at once) until it is SERVING, for at most `seconds`."""
    streams = {
        name: health.Watch(health_pb2.HealthCheckRequest(service=name), timeout=seconds)
        for name in ("", SERVICE)
    }
    seen: dict[str, list[int]] = {}
    for name, stream in streams.items():
        statuses = seen[name] = []
        for response in stream:
            if not statuses or statuses[-1] != response.status:
                statuses.append(response.status)
            if response.status == health_pb2.HealthCheckResponse.SERVING:
                break
        stream.cancel()
    return seen


def test_engine_sigkill_fails_inflight_calls_unavailable_and_recovers(server: Server) -> None:
    probe = _probe_tokens(server)
    version = _version(server)
    weights = prompt_logprobs(server.stub, MODEL, probe)
    train = _group_request(server, MODEL, 4)
    engine_pid = _engine_pids(server)[-1]

    # Stopped first, so the calls below are surely waiting on the engine when it is killed.
    os.kill(engine_pid, signal.SIGSTOP)
    outcomes: dict[str, grpc.StatusCode] = {}

    def call(label: str, invoke: object) -> None:
        try:
            invoke()  # type: ignore[operator]
            outcomes[label] = grpc.StatusCode.OK
        except grpc.RpcError as err:
            outcomes[label] = err.code()

    threads = [
        threading.Thread(target=call, args=("train", lambda: server.stub.Train(train, timeout=CALL_TIMEOUT))),
        threading.Thread(
            target=call, args=("sample", lambda: sample_chat(server.stub, MODEL, "hello", n=2, max_tokens=8))
        ),
    ]
    for thread in threads:
        thread.start()
    # Nothing outside the server tells that both calls are waiting on the stopped engine (no event, no
    # counter): a second is ample for two requests to reach it on loopback.
    time.sleep(1.0)
    health = health_pb2_grpc.HealthStub(server.channel)
    assert health.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
    killed_at = time.monotonic()
    os.kill(engine_pid, signal.SIGKILL)
    for thread in threads:
        thread.join(CALL_TIMEOUT)
    failed_after = time.monotonic() - killed_at
    assert outcomes == {"train": grpc.StatusCode.UNAVAILABLE, "sample": grpc.StatusCode.UNAVAILABLE}

    # Health checking tells load balancers and probes about the restart window, server and service alike.
    for name, seen in _health_statuses(health, CALL_TIMEOUT).items():
        assert seen[0] == health_pb2.HealthCheckResponse.NOT_SERVING, (name, seen)
        assert seen[-1] == health_pb2.HealthCheckResponse.SERVING, (name, seen)

    # Later calls wait for the new engine and succeed: same version, same weights, old samplers valid.
    assert _version(server) == version
    assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(weights, abs=1e-6)
    recovered_after = time.monotonic() - killed_at
    pids = _engine_pids(server)
    assert len(pids) == 2 and pids[-1] != engine_pid
    assert server.stub.Train(train, timeout=CALL_TIMEOUT).policy_version == version + 1
    assert len(sample_chat(server.stub, MODEL, "hi", version=version).sequences) == 4
    restart = re.search(r"embedded engine restarted \(pid \d+\) in ([\d.]+)s", server.proc.log())
    assert restart is not None
    print(
        f"\nengine SIGKILL: in-flight calls failed UNAVAILABLE after {failed_after:.2f}s; "
        f"engine restarted in {restart.group(1)}s; first call answered {recovered_after:.1f}s after the kill"
    )
