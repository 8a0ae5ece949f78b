"""The engine's session records are bounded (engine/sessions.py, MAX_ENGINE_SESSION_RECORDS): past the cap
the oldest records of ended sessions are forgotten, never a running session's nor one the engine still
needs, and a forgotten one stays forgotten across restarts (the index journal and its compaction)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from tinkerrpc.contract.limits import MAX_ENGINE_SESSION_RECORDS
from tinkerrpc_server.engine.sessions import SessionRecord, Sessions
from tinkerrpc_server.engine.storage import Storage

pytestmark = pytest.mark.unit


def recorded(sessions: Sessions) -> list[str]:
    """The recorded session ids, oldest first."""
    return [record.session_id for record in reversed(sessions.records())]


def test_past_the_cap_the_oldest_ended_sessions_are_forgotten_first(tmp_path: Path) -> None:
    assert Sessions(120.0, Storage(tmp_path / "default")).cap == MAX_ENGINE_SESSION_RECORDS
    storage = Storage(tmp_path / "data")
    needed: set[str] = set()
    sessions = Sessions(120.0, storage, keep=lambda session_id: session_id in needed, cap=3)
    oldest, still_used, running = (sessions.open(SessionRecord("", "", tags=[n])) for n in "abc")
    sessions.mark_finished(oldest)
    sessions.mark_finished(still_used, {"reason": {"type": "success"}, "detail": None})
    needed.add(still_used)  # e.g. its training client is still unloading, or it holds a checkpoint
    assert recorded(sessions) == [oldest, still_used, running]

    newer = sessions.open()  # 4 > 3: the oldest ended one that is not kept goes
    assert recorded(sessions) == [still_used, running, newer]
    assert sessions.record(oldest) is None and not sessions.alive(oldest)  # still finished for heartbeats
    # Nothing else may go: the others are running or kept, so the cap gives way rather than drop them.
    newest = sessions.open()
    assert recorded(sessions) == [still_used, running, newer, newest]
    sessions.mark_finished(newer)
    sessions.mark_finished(newest)
    last = sessions.open()  # 5 records, 2 over: newer and newest (oldest first), never still_used
    assert recorded(sessions) == [still_used, running, last]
    finish = {"reason": {"type": "success"}, "detail": None}
    record = sessions.record(still_used)
    assert record is not None and (record.tags, record.finish) == (["b"], finish)
    storage.close()

    storage = Storage(tmp_path / "data")  # replays the journal, then compacts it
    assert recorded(Sessions(120.0, storage, cap=3)) == [still_used, running, last]
    storage.close()
    storage = Storage(tmp_path / "data")  # the compacted journal holds the same
    assert recorded(Sessions(120.0, storage, cap=3)) == [still_used, running, last]
    storage.close()


def test_a_silent_session_counts_as_ended(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    sessions = Sessions(0.2, storage, cap=1)
    first = sessions.open()
    second = sessions.open()  # the first still heartbeats within the timeout: both stay
    assert recorded(sessions) == [first, second]
    time.sleep(0.3)  # both silent past the timeout now: ended, though not yet finished by the sweep
    third = sessions.open()
    assert recorded(sessions) == [third]
    storage.close()
