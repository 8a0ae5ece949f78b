"""Retention: disk and memory stay bounded on a long run. The service runs as on Tinker cloud (`serve
--tinker-url` at this module's engine, a full state every step as on the embedded engine) so the tests
see the engine's files and its count of live training clients (debug/stats, behind its key).

Disk within one run: after 100 steps it is within a constant of the disk after 25 under the default
policy, with as many checkpoints. Step times are bench/retention.py's (50 vs 500 steps, and after restores).
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import grpc
import httpx
import pytest
from svc import CALL_TIMEOUT, TINY, Server, assistant, create_model, poll_until, sample_chat, user

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.engine.storage import read_index
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

STATE = types_pb2.CHECKPOINT_KIND_STATE
SAMPLER = types_pb2.CHECKPOINT_KIND_SAMPLER


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("retention-engine")
    with LocalEngine(tmp / "data", service_model_dir, tmp / "engine.log", startup_timeout=240) as running:
        yield running


@pytest.fixture(scope="module")
def remote(
    tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path, engine: LocalEngine
) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("retention-serve")
    env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
    server = Server(
        tmp / "data", service_model_dir, tmp / "serve.log", env,
        "--tinker-url", engine.base_url, "--checkpoint-every", "1",
    )  # fmt: skip
    yield server
    assert server.close() == 0, server.proc.log()[-3000:]


def _train(server: Server, model: str) -> None:
    request = pb.TrainRequest(model=model, adam=types_pb2.AdamParams(learning_rate=1e-3))
    request.examples.add(messages=[user("respond with yes"), assistant("yes")])
    server.stub.Train(request, timeout=CALL_TIMEOUT)


def _disk(directory: Path) -> int:
    """Bytes of the files under `directory`; one the engine's retention sweep deletes while this walks
    counts nothing (the walk listed it, then it went)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            with contextlib.suppress(FileNotFoundError):
                total += os.path.getsize(Path(root) / name)
    return total


def _live_models(engine: LocalEngine) -> int:
    stats = httpx.get(f"{engine.base_url}/api/v1/debug/stats", headers=engine.auth_headers, timeout=30)
    stats.raise_for_status()
    return int(stats.json()["live_models"])


def _checkpoint_names(engine_data_dir: Path, run_id: str) -> set[str]:
    _, checkpoints = read_index(engine_data_dir)
    return {c.checkpoint_id for c in checkpoints if c.model_id == run_id}


def _settled_checkpoint_names(server: Server, engine: LocalEngine, model: str, run_id: str) -> set[str]:
    """The run's checkpoints on the engine once the last step's pruned files are deleted (GetModel waits
    for that, as it does for their sizes)."""
    server.stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT)
    return _checkpoint_names(engine.data_dir, run_id)


def test_disk_stays_flat(remote: Server, engine: LocalEngine) -> None:
    model = "long-run"
    created = create_model(remote.stub, model, rank=1)
    assert (created.keep_sampler_versions, created.keep_state_checkpoints) == (16, 4)
    for _ in range(25):
        _train(remote, model)
    disk_at_25 = _disk(engine.data_dir)
    files_at_25 = _settled_checkpoint_names(remote, engine, model, created.tinker_run_id)
    for _ in range(75):
        _train(remote, model)
    disk_at_100 = _disk(engine.data_dir)
    assert disk_at_100 <= 1.2 * disk_at_25, (disk_at_25, disk_at_100)
    # The engine holds as many of the run's checkpoints as at step 25: 16 sampler versions, 4 states.
    files_at_100 = _settled_checkpoint_names(remote, engine, model, created.tinker_run_id)
    assert len(files_at_25) == len(files_at_100) == 20, (files_at_25, files_at_100)

    info = remote.stub.GetModel(pb.GetModelRequest(name=model)).model
    assert list(info.sampleable_versions) == list(range(85, 101))
    states = [
        c.name
        for c in remote.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=model)).checkpoints
        if c.kind == STATE
    ]
    assert sorted(states) == [f"step_{v:06d}" for v in range(97, 101)]
    assert info.checkpoint_bytes > 0
    remote.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)


def test_per_model_policy_keeps_named_versions(remote: Server) -> None:
    model = "short-memory"
    remote.stub.CreateModel(
        pb.CreateModelRequest(
            name=model, base_model=TINY, lora=types_pb2.LoraConfig(rank=1),
            keep_sampler_versions=2, keep_state_checkpoints=1,
        ),
        timeout=CALL_TIMEOUT,
    )  # fmt: skip
    _train(remote, model)
    remote.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=model, name="mark"), timeout=CALL_TIMEOUT)
    sizes = [remote.stub.GetModel(pb.GetModelRequest(name=model)).model.checkpoint_bytes]
    for _ in range(4):
        _train(remote, model)
        sizes.append(remote.stub.GetModel(pb.GetModelRequest(name=model)).model.checkpoint_bytes)
    info = remote.stub.GetModel(pb.GetModelRequest(name=model)).model
    assert (info.keep_sampler_versions, info.keep_state_checkpoints) == (2, 1)
    # The named checkpoint's version stays sampleable besides the latest two.
    assert list(info.sampleable_versions) == [1, 4, 5]
    listed = remote.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=model)).checkpoints
    assert sorted((c.name, c.kind) for c in listed) == [
        ("mark", STATE), ("step_000005", STATE), ("v000001", SAMPLER), ("v000004", SAMPLER),
        ("v000005", SAMPLER),
    ]  # fmt: skip
    assert max(sizes[2:]) <= 1.5 * min(sizes[2:]), sizes
    with pytest.raises(grpc.RpcError) as err:
        sample_chat(remote.stub, model, "hi", n=1, max_tokens=1, version=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    with pytest.raises(grpc.RpcError) as err:
        remote.stub.CreateModel(
            pb.CreateModelRequest(name="zero-keep", base_model=TINY, keep_sampler_versions=0),
            timeout=CALL_TIMEOUT,
        )
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    remote.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)


def test_restores_free_their_training_clients(remote: Server, engine: LocalEngine) -> None:
    model = "memory"
    baseline = _live_models(engine)
    create_model(remote.stub, model, rank=4)
    _train(remote, model)
    remote.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=model, name="base"), timeout=CALL_TIMEOUT)
    for _ in range(50):
        remote.stub.RestoreCheckpoint(
            pb.RestoreCheckpointRequest(model=model, checkpoint="base"), timeout=CALL_TIMEOUT
        )
    _train(remote, model)
    # Each unload runs after its client's queued work: the count settles within moments.
    assert poll_until(lambda: _live_models(engine) == baseline + 1, 30), "the model's current client only"
    remote.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)
    assert poll_until(lambda: _live_models(engine) == baseline, 30)


def _rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError(f"no VmRSS for pid {pid}")


CUT_TRAINS = 30
CUT_DEADLINE_SECONDS = 0.06
RSS_GROWTH_BOUND = 20 * 2**20


def test_trains_cut_by_their_deadline_free_what_they_built(remote: Server, engine: LocalEngine) -> None:
    """A Train cut by its deadline leaves its model to roll back; the next one's rebuild, cut too, must
    not leave the client it was building on the engine."""
    model = "cut-short"
    baseline = _live_models(engine)
    create_model(remote.stub, model, rank=1)

    def cut_train() -> None:
        request = pb.TrainRequest(model=model, adam=types_pb2.AdamParams(learning_rate=1e-3))
        request.examples.add(messages=[user("respond with yes"), assistant("yes")])
        try:
            remote.stub.Train(request, timeout=CUT_DEADLINE_SECONDS)
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.DEADLINE_EXCEEDED, err

    for _ in range(5):  # warm-up: the first rollbacks allocate what later ones reuse
        cut_train()
    warm_rss = _rss_bytes(remote.proc.pid)
    for _ in range(CUT_TRAINS):
        cut_train()
    _train(remote, model)
    assert poll_until(lambda: _live_models(engine) == baseline + 1, 30), _live_models(engine)
    assert _rss_bytes(remote.proc.pid) - warm_rss < RSS_GROWTH_BOUND
    remote.stub.DeleteModel(pb.DeleteModelRequest(name=model), timeout=CALL_TIMEOUT)
    assert poll_until(lambda: _live_models(engine) == baseline, 30)


def test_orphans_of_an_uncommitted_step_are_deleted_at_start(tmp_path: Path, service_model_dir: Path) -> None:
    model = "orphans"
    data_dir = tmp_path / "data"
    crashing = Server(data_dir, service_model_dir, tmp_path / "crash.log", crash_at="before_commit")
    run_id = create_model(crashing.stub, model, rank=1).tinker_run_id
    with pytest.raises(grpc.RpcError):
        _train(crashing, model)
    assert crashing.proc.wait(30) == 137
    crashing.close()
    # The step saved its weights and state, and died before committing them.
    assert {"sampler_weights/v000001", "weights/step_000001"} <= _checkpoint_names(
        data_dir / "engine", run_id
    )

    server = Server(data_dir, service_model_dir, tmp_path / "serve.log")
    try:
        assert server.stub.GetModel(pb.GetModelRequest(name=model)).model.policy_version == 0
        assert _checkpoint_names(data_dir / "engine", run_id) == {
            "sampler_weights/v000000",
            "weights/step_000000",
        }
    finally:
        assert server.close() == 0, server.proc.log()[-3000:]
