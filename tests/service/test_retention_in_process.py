"""Retention in-process over the fake backend: which checkpoint rows and backend files each policy keeps
(the server's defaults, a model's own keep_* fields, named state checkpoints, versions pinned by a Sample
in flight), the sizes ModelInfo sums, orphans deleted at start, and dropped training clients unloaded."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_backend import SAMPLER_BYTES, STATE_BYTES, FakeCheckpoint, FakeTinker
from in_process import InProcessService

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE
from tinkerrpc_server.service.training import StepPoint

pytestmark = pytest.mark.unit


def _kept(service: InProcessService, model: str) -> list[tuple[str, int]]:
    return sorted((c.name, c.kind) for c in service.store.list_checkpoints(model))


def _files(service: InProcessService, model: str) -> set[str]:
    """The backend's checkpoint files in the model's training runs."""
    runs = {c.tinker_path.split("/")[2] for c in service.store.list_checkpoints(model)}
    return {path for path in service.fake.checkpoints if path.split("/")[2] in runs}


async def test_the_default_policy_keeps_the_latest_versions_and_states(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    limits = Limits(keep_sampler_versions=6, keep_state_checkpoints=2)
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs, limits=limits)
    info = await service.create("m")
    assert (info.keep_sampler_versions, info.keep_state_checkpoints) == (6, 2)
    counts = []
    for i in range(1, 21):
        await service.train("m", f"step {i}")
        counts.append((len(service.store.list_checkpoints("m")), len(_files(service, "m"))))
    # Once the policy is full, each step adds as many rows and files as it prunes.
    assert counts[6:] == [(8, 8)] * 14
    assert service.store.sampleable_versions("m") == list(range(15, 21))
    assert _kept(service, "m") == sorted(
        [(f"v{v:06d}", KIND_SAMPLER) for v in range(15, 21)]
        + [(f"step_{v:06d}", KIND_STATE) for v in (19, 20)]
    )
    # Every file left on the backend is a kept row's, and ModelInfo sums their sizes.
    assert _files(service, "m") == {c.tinker_path for c in service.store.list_checkpoints("m")}
    assert (
        service.models.info(service.models.row("m")).checkpoint_bytes == 6 * SAMPLER_BYTES + 2 * STATE_BYTES
    )


async def test_a_models_policy_keeps_named_versions_and_pins(tmp_path: Path, codecs: ChatCodecs) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs)
    info = await service.create("m", keep_sampler_versions=2, keep_state_checkpoints=1)
    assert (info.keep_sampler_versions, info.keep_state_checkpoints) == (2, 1)
    await service.train("m", "step 1")
    await service.checkpoints.save(pb.SaveCheckpointRequest(model="m", name="mark"))
    await service.train("m", "step 2")
    with service.models.retention.pinned("m", 2):
        for i in range(3, 6):
            await service.train("m", f"step {i}")
        # Version 2 is being sampled: it stays until the Sample ends.
        assert service.store.sampleable_versions("m") == [1, 2, 4, 5]
    await service.train("m", "step 6")
    # The named checkpoint's version stays sampleable besides the latest two; the pin went with its Sample.
    assert service.store.sampleable_versions("m") == [1, 5, 6]
    assert _kept(service, "m") == [
        ("mark", KIND_STATE), ("step_000006", KIND_STATE), ("v000001", KIND_SAMPLER), ("v000005", KIND_SAMPLER),
        ("v000006", KIND_SAMPLER),
    ]  # fmt: skip
    assert _files(service, "m") == {c.tinker_path for c in service.store.list_checkpoints("m")}


async def test_the_recovery_point_is_kept_whatever_the_policy(tmp_path: Path, codecs: ChatCodecs) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs, checkpoint_every=3)
    await service.create("m", keep_sampler_versions=1, keep_state_checkpoints=1)
    for i in range(1, 6):
        await service.train("m", f"step {i}")
    row = service.models.row("m")
    assert row.recovery_version == 3
    assert _kept(service, "m") == [("step_000003", KIND_STATE), ("v000005", KIND_SAMPLER)]
    assert row.recovery_path in _files(service, "m")


class _Killed(Exception):
    pass


class _CrashAt:
    """Stops a step at `point` as a killed process would: nothing after it runs."""

    def __init__(self, point: StepPoint) -> None:
        self.point = point

    def reached(self, point: StepPoint) -> None:
        if point == self.point:
            raise _Killed(point)


async def test_files_of_an_uncommitted_step_are_deleted_at_start(tmp_path: Path, codecs: ChatCodecs) -> None:
    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, hooks=_CrashAt("before_commit"))
    run_id = (await service.create("m")).tinker_run_id
    unrelated = f"tinker://{run_id}/weights/my-own-export"
    fake.checkpoints[unrelated] = FakeCheckpoint(unrelated, "weights/my-own-export", 1, "weights")
    with pytest.raises(_Killed):
        await service.train("m", "a step that never commits")
    assert {f"tinker://{run_id}/sampler_weights/v000001", f"tinker://{run_id}/weights/step_000001"} <= set(
        fake.checkpoints
    )
    service.close()

    restarted = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs)
    await restarted.models.recover()
    assert restarted.models.row("m").policy_version == 0
    # Only names of the server's own pattern are deleted.
    assert set(fake.checkpoints) == {
        f"tinker://{run_id}/sampler_weights/v000000", f"tinker://{run_id}/weights/step_000000", unrelated,
    }  # fmt: skip


async def test_dropped_training_clients_are_unloaded(tmp_path: Path, codecs: ChatCodecs) -> None:
    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs)
    await service.create("m")
    await service.train("m", "step 1")
    await service.checkpoints.save(pb.SaveCheckpointRequest(model="m", name="base"))
    for _ in range(5):
        await service.checkpoints.restore(pb.RestoreCheckpointRequest(model="m", checkpoint="base"))
    await service.train("m", "step 2")
    await service.settled()
    assert len(fake.clients) == 6
    assert fake.live_clients == {(await service.training_client("m")).model_id}
    await service.models.delete("m")
    await service.settled()
    assert fake.live_clients == set()
    assert fake.checkpoints == {}
