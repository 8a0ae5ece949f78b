"""The engine's records behind the SDK's REST calls (engine/records.py, sessions.py, storage.py): sessions,
their finish reasons and projects, published flags and copies outlive the engine that made them, through
its index journal and its compaction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tinkerrpc_server.engine.records import Records
from tinkerrpc_server.engine.sessions import SessionRecord, Sessions
from tinkerrpc_server.engine.snapshots import SamplerLedger
from tinkerrpc_server.engine.storage import (
    CheckpointRecord,
    ConflictError,
    RunRecord,
    Storage,
    UnknownPathError,
    now_iso,
)

pytestmark = pytest.mark.unit


def open_records(data_dir: Path) -> tuple[Storage, Records]:
    storage = Storage(data_dir)
    return storage, Records(storage, Sessions(120.0, storage), SamplerLedger(10.0))


def saved_checkpoint(storage: Storage, model_id: str, name: str) -> CheckpointRecord:
    stamp = now_iso()
    storage.put_run(RunRecord(model_id, "tiny-chat", 4, 1, True, True, False, stamp, stamp))
    directory = storage.checkpoint_dir(model_id, "training", name)
    directory.mkdir(parents=True)
    (directory / "adapter.bin").write_bytes(b"w" * 1000)
    record = CheckpointRecord(model_id, "training", name, stamp, 1000)
    storage.add_checkpoint(record)
    return record


def test_sessions_finishes_projects_and_public_flags_outlive_the_engine(tmp_path: Path) -> None:
    storage, records = open_records(tmp_path)
    session_id = records.open_session(
        SessionRecord("", "", tags=["t"], user_metadata={"k": "v"}, project_id="p")
    )
    other = records.open_session(SessionRecord("", "", display_name="second"))
    records.set_project(session_id, "q")
    Sessions(120.0, storage).mark_finished(session_id, {"reason": {"type": "errored"}, "detail": "boom"})
    Sessions(120.0, storage).mark_finished(session_id, {"reason": {"type": "success"}, "detail": None})
    checkpoint = saved_checkpoint(storage, f"{session_id}:train:0", "s1")
    records.set_public(checkpoint.tinker_path, True)
    with pytest.raises(ConflictError):
        records.set_public(checkpoint.tinker_path, True)
    storage.close()

    storage, records = open_records(tmp_path)  # replays the journal, then compacts it
    assert records.session_ids() == [other, session_id]  # newest first
    view = records.session(session_id)
    assert (view.record.tags, view.record.user_metadata, view.record.project_id) == (["t"], {"k": "v"}, "q")
    assert view.record.finish == {"reason": {"type": "errored"}, "detail": "boom"}  # the first finish wins
    assert not view.running and view.training_run_ids == [f"{session_id}:train:0"]
    assert [c.public for c in view.checkpoints] == [True]
    storage.close()
    storage, records = open_records(tmp_path)  # the compacted journal holds the same
    assert records.session(other).record.display_name == "second"
    assert records.session(session_id).checkpoints[0].public
    with pytest.raises(UnknownPathError):
        records.session("s-never")
    storage.close()


def test_a_copy_shares_its_sources_files_and_counts_them_once(tmp_path: Path) -> None:
    storage, records = open_records(tmp_path)
    source = saved_checkpoint(storage, "s0:train:0", "s1")
    copied = records.copy_checkpoint(source.tinker_path, None, "archive", None, "key-1")
    assert records.copy_checkpoint(source.tinker_path, None, "archive", None, "key-1") == copied
    model_id = copied.removeprefix("tinker://").split("/")[0]
    assert copied == f"tinker://{model_id}/weights/s1" and model_id != source.model_id
    first = storage.checkpoint_dir(source.model_id, "training", "s1") / "adapter.bin"
    second = storage.checkpoint_dir(model_id, "training", "s1") / "adapter.bin"
    assert os.path.samefile(first, second)
    use = {u.project_id: u for u in records.storage_use()}
    assert use["archive"].checkpoint_count == use[None].checkpoint_count == 1
    assert sum(u.size_bytes for u in use.values()) == 1000  # the shared bytes count once
    assert records.session(model_id.split(":train:")[0]).record.finish is not None
    storage.delete_checkpoint(source.model_id, "weights/s1")
    assert second.read_bytes() == b"w" * 1000
    open_session = records.open_session(SessionRecord("", ""))
    assert records.copy_checkpoint(copied, (open_session, 5), None, None, None).startswith(
        f"tinker://{open_session}:"
    )
    with pytest.raises(ConflictError):
        records.copy_checkpoint(copied, (open_session, 5), None, None, None)
    storage.close()
