"""Nothing acknowledged is lost and nothing is applied twice, at any --checkpoint-every: the server is killed
the way SIGKILL would (crashing_server.py's step hook, os._exit(137)) at seeded random points of random
Train steps, KILLS times per run, and restarted on the same data dir each time. The servers use one
separately started engine (as on Tinker cloud), so a restart costs only the server's own start.

After every restart: the model is at exactly the versions acknowledged (plus the killed step when it died
after its commit), every acknowledged key retried answers replayed=true with the recorded response, the
killed step retried with its key is applied once, and the weights of every version, those trained after a
replay included, equal an uninterrupted run's: the probe's prompt logprobs at each version are compared
with REPLAY_TOLERANCE (measured: bitwise equal on the CPU engine, max |difference| 0.0)."""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path
from typing import get_args

import grpc
import pytest
from svc import CALL_TIMEOUT, Server, create_model, prompt_logprobs

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.service.training import StepPoint

pytestmark = pytest.mark.process

MODEL = "replayed"
KILLS = 10
# A life ends at its kill after at most this many steps reach the kill point.
MAX_STEPS_PER_LIFE = 3
# Steps the final, unkilled life trains on the recovered state.
FINAL_STEPS = 2
# Replayed weights against the uninterrupted run's, as prompt logprobs: the CPU engine is deterministic.
REPLAY_TOLERANCE = 1e-6
PROBE = [11, 23, 35, 47, 59, 71, 83, 95]


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("replay-engine")
    with LocalEngine(tmp / "data", service_model_dir, tmp / "engine.log", startup_timeout=240) as running:
        yield running


def _serve(
    tmp: Path, model_dir: Path, engine: LocalEngine, tag: str, *extra: str, crash_at: str = ""
) -> Server:
    env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
    return Server(
        tmp / "data",
        model_dir,
        tmp / f"serve-{tag}.log",
        env,
        "--tinker-url",
        engine.base_url,
        *extra,
        crash_at=crash_at,
    )


def _request(step: int) -> pb.TrainRequest:
    """The step that makes version step + 1: fixed tokens, so every run trains the same datums."""
    rng = random.Random(step)
    request = pb.TrainRequest(
        model=MODEL, adam=types_pb2.AdamParams(learning_rate=2e-2), idempotency_key=f"step-{step}"
    )
    group = request.groups.add()
    prompt = [rng.randrange(10, 100) for _ in range(5)]
    for reward in (1.0, 0.0, 0.5):
        completion = [rng.randrange(10, 100) for _ in range(3)]
        group.trajectories.add(reward=reward).turns.add(
            prompt_token_ids=prompt,
            completion_token_ids=completion,
            completion_logprobs=[-2.0] * len(completion),
            policy_version=step,
        )
    return request


def _probe(server: Server, version: int) -> list[float]:
    return prompt_logprobs(server.stub, MODEL, PROBE, version=version)


class Uninterrupted:
    """A server that is never killed, training the same steps as far as a test needs them."""

    def __init__(self, server: Server) -> None:
        self.server = server
        create_model(server.stub, MODEL)
        self._probes = [_probe(server, 0)]

    def probe(self, version: int) -> list[float]:
        """The probe at `version` of the uninterrupted run."""
        while len(self._probes) <= version:
            step = len(self._probes) - 1
            assert self.server.stub.Train(_request(step), timeout=CALL_TIMEOUT).policy_version == step + 1
            self._probes.append(_probe(self.server, step + 1))
        return self._probes[version]


@pytest.fixture(scope="module")
def uninterrupted(
    tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path, engine: LocalEngine
) -> Iterator[Uninterrupted]:
    server = _serve(tmp_path_factory.mktemp("uninterrupted"), service_model_dir, engine, "uninterrupted")
    yield Uninterrupted(server)
    assert server.close() == 0, server.proc.log()[-3000:]


def _acknowledged_as_recorded(server: Server, acknowledged: dict[int, pb.TrainResponse]) -> None:
    for step, response in acknowledged.items():
        retried = server.stub.Train(_request(step), timeout=CALL_TIMEOUT)
        assert retried.replayed, f"step {step} was applied again"
        retried.replayed = False
        assert retried == response, f"step {step}'s retry answers another response"


@pytest.mark.parametrize("checkpoint_every", [1, 10])
def test_random_kills_lose_no_acknowledged_step_and_apply_none_twice(
    checkpoint_every: int,
    tmp_path: Path,
    service_model_dir: Path,
    engine: LocalEngine,
    uninterrupted: Uninterrupted,
) -> None:
    rng = random.Random(12 + checkpoint_every)
    acknowledged: dict[int, pb.TrainResponse] = {}
    cadence = ("--checkpoint-every", str(checkpoint_every))
    died_after_commit = False
    for life in range(KILLS + 1):
        killed = life < KILLS
        point: StepPoint = rng.choice(get_args(StepPoint))
        crash = ("--crash-after", str(rng.randint(1, MAX_STEPS_PER_LIFE))) if killed else ()
        server = _serve(
            tmp_path,
            service_model_dir,
            engine,
            f"life-{life}",
            *cadence,
            *crash,
            crash_at=point if killed else "",
        )
        try:
            if life == 0:
                create_model(server.stub, MODEL)
            step = len(acknowledged)
            model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
            assert model.policy_version == step + died_after_commit, f"life {life}: a version was lost"
            assert _probe(server, model.policy_version) == pytest.approx(
                uninterrupted.probe(model.policy_version), abs=REPLAY_TOLERANCE
            )
            _acknowledged_as_recorded(
                server, {s: acknowledged[s] for s in rng.sample(sorted(acknowledged), min(3, step))}
            )
            # A killed life reaches its kill point within MAX_STEPS_PER_LIFE steps after a replayed one.
            last = step + (MAX_STEPS_PER_LIFE + 1 if killed else FINAL_STEPS)
            while step < last:
                try:
                    response = server.stub.Train(_request(step), timeout=CALL_TIMEOUT)
                except grpc.RpcError as err:
                    assert killed and err.code() == grpc.StatusCode.UNAVAILABLE, err
                    break
                # The step the last kill cut short after its commit is answered from its record.
                assert response.replayed == died_after_commit, f"life {life}, step {step}"
                died_after_commit = False
                assert response.policy_version == step + 1, "a step was applied twice or lost"
                response.replayed = False
                acknowledged[step] = response
                assert _probe(server, step + 1) == pytest.approx(
                    uninterrupted.probe(step + 1), abs=REPLAY_TOLERANCE
                ), f"life {life}: version {step + 1}'s weights differ from the uninterrupted run's"
                step += 1
            if killed:
                assert server.proc.wait(30) == 137, f"life {life} was not killed at {point}"
                died_after_commit = point == "after_commit"
            else:
                _acknowledged_as_recorded(server, acknowledged)
        finally:
            server.close()


def test_restore_keeps_every_idempotency_record(uninterrupted: Uninterrupted) -> None:
    server = uninterrupted.server
    name = "restored"
    create_model(server.stub, name)

    def train(step: int) -> pb.TrainResponse:
        request = _request(step)
        request.model = name
        return server.stub.Train(request, timeout=CALL_TIMEOUT)

    responses = [train(step) for step in range(2)]
    server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=name, name="at-two"), timeout=CALL_TIMEOUT)
    responses += [train(step) for step in range(2, 4)]
    restored = server.stub.RestoreCheckpoint(
        pb.RestoreCheckpointRequest(model=name, checkpoint="at-two"), timeout=CALL_TIMEOUT
    ).model
    assert restored.policy_version == 2
    for step, response in enumerate(responses):
        retried = train(step)
        assert retried.replayed and retried.policy_version == response.policy_version, step
    # A new step after the restore takes version 3 again: the keys of the abandoned versions stay answered.
    fresh = _request(2)
    fresh.model, fresh.idempotency_key = name, "after-restore"
    assert server.stub.Train(fresh, timeout=CALL_TIMEOUT).policy_version == 3
    assert train(3).replayed
