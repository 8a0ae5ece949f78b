"""The engine's training-run records are bounded (engine/storage.py, forget_idle_runs): a run with no
checkpoint and no live training client is forgotten once idle past MAX_ENGINE_IDLE_RUN_SECONDS, and the
least recently used such runs past MAX_ENGINE_RUN_RECORDS; never a run with a checkpoint or a live client.
A forgotten run stays forgotten across restarts (the index journal) and compactions. Also: the finished
session ids the engine remembers are bounded by MAX_ENGINE_FINISHED_SESSION_IDS."""

from __future__ import annotations

import time
from datetime import datetime, timedelta, timezone
from pathlib import Path

import pytest

from tinkerrpc.contract.limits import (
    MAX_ENGINE_FINISHED_SESSION_IDS,
    MAX_ENGINE_IDLE_RUN_SECONDS,
    MAX_ENGINE_RUN_RECORDS,
)
from tinkerrpc_server.engine.sessions import Sessions
from tinkerrpc_server.engine.storage import CheckpointRecord, RunRecord, Storage, UnknownPathError, read_index

pytestmark = pytest.mark.unit

HOUR = 3600.0


def stamp(hours_ago: float) -> str:
    return (datetime.now(timezone.utc) - timedelta(hours=hours_ago)).isoformat()


def put_run(storage: Storage, model_id: str, hours_ago: float) -> None:
    """A run whose last request was `hours_ago` hours ago."""
    storage.put_run(
        RunRecord(model_id, "tiny-chat", 4, 1, True, True, False, stamp(hours_ago), stamp(hours_ago))
    )


def save_checkpoint(storage: Storage, model_id: str, name: str, hours_ago: float) -> CheckpointRecord:
    directory = storage.checkpoint_dir(model_id, "training", name)
    directory.mkdir(parents=True)
    (directory / "adapter.bin").write_bytes(b"w" * 10)
    record = CheckpointRecord(model_id, "training", name, stamp(hours_ago), 10)
    storage.add_checkpoint(record)
    return record


def run_ids(storage: Storage) -> set[str]:
    return {run.model_id for run in storage.list_runs()}


def test_past_the_cap_the_least_recently_used_idle_runs_go_and_stay_gone(tmp_path: Path) -> None:
    storage = Storage(tmp_path, run_cap=3, run_max_idle_seconds=100 * HOUR)
    assert (storage.run_cap, storage.run_max_idle_seconds) == (3, 100 * HOUR)
    default = Storage(tmp_path / "default")
    assert (default.run_cap, default.run_max_idle_seconds) == (
        MAX_ENGINE_RUN_RECORDS,
        MAX_ENGINE_IDLE_RUN_SECONDS,
    )
    default.close()
    put_run(storage, "saved", 9)
    checkpoint = save_checkpoint(storage, "saved", "kept", 8)  # the run's last request: 8 hours ago
    put_run(storage, "live", 7)
    for model_id, hours_ago in [("idle_a", 6), ("idle_c", 4), ("idle_b", 5), ("idle_d", 3)]:
        put_run(storage, model_id, hours_ago)
    live = {"live"}

    # 6 runs, cap 3: the 3 least recently used idle ones go; the older run with a checkpoint and the live
    # run, older still, stay.
    assert storage.forget_idle_runs(lambda model_id: model_id in live) == ["idle_a", "idle_b", "idle_c"]
    assert run_ids(storage) == {"saved", "live", "idle_d"}
    with pytest.raises(UnknownPathError, match="unknown training run 'idle_a'"):
        storage.get_run("idle_a")
    assert storage.resolve(checkpoint.tinker_path)[0] == checkpoint
    # Over the cap with nothing idle to forget, the cap gives way.
    put_run(storage, "fresh", 0)
    live |= {"idle_d", "fresh"}
    assert storage.forget_idle_runs(lambda model_id: model_id in live) == []
    assert run_ids(storage) == {"saved", "live", "idle_d", "fresh"}
    storage.close()

    # A restart replays the forgetting (the journal's lines, read with a cap that would keep them all),
    # then compacts the journal to one line per record, which keeps it.
    for _ in range(2):
        storage = Storage(tmp_path, run_cap=100, run_max_idle_seconds=100 * HOUR)
        assert run_ids(storage) == {"saved", "live", "idle_d", "fresh"}
        storage.close()
    assert len((tmp_path / "engine_index.jsonl").read_text().splitlines()) == 5  # 4 runs + 1 checkpoint


def test_an_idle_run_goes_once_idle_past_the_limit_and_at_start_every_run_counts_as_unloaded(
    tmp_path: Path,
) -> None:
    storage = Storage(tmp_path, run_max_idle_seconds=2 * HOUR)
    put_run(storage, "stale", 3)
    put_run(storage, "recent", 1)
    put_run(storage, "stale_live", 3)
    put_run(storage, "stale_saved", 4)
    save_checkpoint(storage, "stale_saved", "kept", 3)
    assert storage.forget_idle_runs(lambda model_id: model_id == "stale_live") == ["stale"]
    assert run_ids(storage) == {"recent", "stale_live", "stale_saved"}
    storage.close()

    # No training client outlives its engine: at start the stale run of a client that was live goes.
    storage = Storage(tmp_path, run_max_idle_seconds=2 * HOUR)
    assert run_ids(storage) == {"recent", "stale_saved"}
    storage.close()
    assert {run.model_id for run in read_index(tmp_path)[0]} == {"recent", "stale_saved"}


def test_a_run_whose_checkpoints_are_all_gone_is_idle(tmp_path: Path) -> None:
    storage = Storage(tmp_path, run_cap=0)
    put_run(storage, "emptied", 1)
    first = save_checkpoint(storage, "emptied", "first", 1)
    second = save_checkpoint(storage, "emptied", "second", 1)
    put_run(storage, "expiring", 1)
    expiring = save_checkpoint(storage, "expiring", "short", 1)
    assert storage.forget_idle_runs(lambda model_id: False) == []
    storage.delete_checkpoint("emptied", first.checkpoint_id)
    assert storage.forget_idle_runs(lambda model_id: False) == []  # one checkpoint is left
    storage.delete_checkpoint("emptied", second.checkpoint_id)
    storage.set_expiry(expiring.tinker_path, time.time() - 1)
    assert [c.tinker_path for c in storage.delete_expired(time.time())] == [expiring.tinker_path]
    assert storage.forget_idle_runs(lambda model_id: False) == ["emptied", "expiring"]
    assert run_ids(storage) == set()
    storage.close()


def test_past_the_lines_a_compaction_allows_the_forgetting_is_compacted_in(tmp_path: Path) -> None:
    storage = Storage(tmp_path, run_cap=1)
    for step in range(300):  # a service that rebuilds its training client after every failed step
        put_run(storage, f"client_{step:03d}", 0)
        assert storage.forget_idle_runs(lambda model_id, step=step: model_id == f"client_{step:03d}") == (
            [f"client_{step - 1:03d}"] if step else []
        )
    journal = (tmp_path / "engine_index.jsonl").read_text().splitlines()
    # 600 changes (a run, then a forgotten run) were compacted along the way into far fewer lines.
    assert len(journal) < 300 and sum("forgotten_run" in line for line in journal) < 150
    assert run_ids(storage) == {"client_299"}
    storage.close()
    storage = Storage(tmp_path, run_cap=100)
    assert run_ids(storage) == {"client_299"}
    storage.close()


def test_the_finished_session_ids_remembered_are_bounded(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    sessions = Sessions(120.0, storage)
    finished = [f"s{n:05d}" for n in range(MAX_ENGINE_FINISHED_SESSION_IDS + 1)]
    for session_id in finished:
        sessions.mark_finished(session_id)
    assert not sessions.alive(finished[1]) and not sessions.alive(finished[-1])  # heartbeats answer 410
    assert sessions.alive(finished[0])  # the oldest was forgotten: adopted, as after a restart
    storage.close()
