"""Recovery in-process over the fake backend: a rebuilt training client is the recovery point (the last
state checkpoint) plus the write-ahead step records after it, replayed in order, at --checkpoint-every 1
and K; a failed step rolls the model back to its committed version; a database whose step records are
missing goes back to the newest version they rebuild."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_backend import FakeTinker
from in_process import InProcessService

from tinkerrpc_server.service.rendering import ChatCodecs

pytestmark = pytest.mark.unit

STEPS = 8


@pytest.mark.parametrize("every", [1, 3])
async def test_a_restart_rebuilds_each_version_from_its_recovery_point_and_records(
    tmp_path: Path, codecs: ChatCodecs, every: int
) -> None:
    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, checkpoint_every=every)
    await service.create("m")
    responses = [await service.train("m", f"step {i}") for i in range(1, STEPS + 1)]
    assert [r.policy_version for r in responses] == list(range(1, STEPS + 1))
    assert [r.HasField("state_checkpoint") for r in responses] == [v % every == 0 for v in range(1, 9)]
    trained = await service.training_client("m")
    recovery_point = STEPS // every * every
    row = service.store.get_model("m")
    assert row is not None and row.recovery_version == recovery_point
    # Only the versions after the recovery point keep their records (fewer than K).
    assert service.store.step_input_versions("m", after=0) == list(range(recovery_point + 1, STEPS + 1))
    service.close()

    restarted = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, checkpoint_every=every)
    await restarted.models.recover()
    rebuilt = await restarted.training_client("m")
    assert rebuilt.model_id != trained.model_id
    assert rebuilt.weights == trained.weights
    assert (await restarted.train("m", "after")).policy_version == STEPS + 1


@pytest.mark.parametrize("every", [1, 3])
@pytest.mark.parametrize("failing", ["forward_backward", "optim_step", "save_weights_for_sampler"])
async def test_a_failed_step_leaves_the_committed_version_and_training_resumes_from_it(
    tmp_path: Path, codecs: ChatCodecs, every: int, failing: str
) -> None:
    uninterrupted = InProcessService.open(
        tmp_path / "a.sqlite3", FakeTinker(), codecs, checkpoint_every=every
    )
    await uninterrupted.create("m")
    for i in range(1, 6):
        await uninterrupted.train("m", f"step {i}")

    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "b.sqlite3", fake, codecs, checkpoint_every=every)
    await service.create("m")
    for i in range(1, 5):
        if i == 3:
            fake.fail_next.add(failing)
            with pytest.raises(RuntimeError, match=f"{failing} failed"):
                await service.train("m", "a step that fails")
            row = service.store.get_model("m")
            assert row is not None and row.policy_version == 2
            assert service.models.runtime("m").dirty
        await service.train("m", f"step {i}")
    await service.train("m", "step 5")

    assert (await service.training_client("m")).weights == (await uninterrupted.training_client("m")).weights
    # The abandoned client was unloaded: the backend holds the model's current client alone.
    await service.settled()
    assert fake.live_clients == {(await service.training_client("m")).model_id}


async def test_versions_without_step_records_roll_back_to_what_the_records_rebuild(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, checkpoint_every=4)
    await service.create("m")
    for i in range(1, 8):
        await service.train("m", f"step {i}")
    # A database of an older release kept no record of versions 6 and 7 (after the recovery point 4).
    assert service.store.step_input_versions("m", after=0) == [5, 6, 7]
    with service.store.transaction() as tx:
        tx.execute("DELETE FROM step_inputs WHERE model = 'm' AND policy_version >= 6")
    service.close()

    restarted = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, checkpoint_every=4)
    await restarted.models.recover()
    row = restarted.store.get_model("m")
    assert row is not None and row.policy_version == 5
    assert restarted.store.sampleable_versions("m") == [0, 1, 2, 3, 4, 5]
    # The sampler files of the versions rolled back are gone from the backend too.
    assert not [path for path in fake.checkpoints if path.endswith(("v000006", "v000007"))]
    five_steps = InProcessService.open(tmp_path / "five.sqlite3", FakeTinker(), codecs, checkpoint_every=4)
    await five_steps.create("m")
    for i in range(1, 6):
        await five_steps.train("m", f"step {i}")
    assert (await restarted.training_client("m")).weights == (await five_steps.training_client("m")).weights
