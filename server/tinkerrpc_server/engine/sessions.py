"""The engine's tinker sessions: which are alive, when each last showed a sign of life, which have
finished. What a session made (training clients `<session>:train:<n>`, sampling sessions
`<session>:sample:<n>`) is freed by the engine when it finishes (core.Engine.finish_session).

Each session the engine opens is recorded in its index (storage.Storage.put_session) as its client
described it (tags, user_metadata, project, display name, SDK version) with how it finished, so the
SDK's session listing and search answer from the engine's own records, across restarts. Bounded: past
MAX_ENGINE_SESSION_RECORDS the oldest records of ended sessions are forgotten, except those the engine
still needs (`keep`: a session with a training client or sampling session in memory, or a checkpoint).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tinkerrpc.contract.limits import MAX_ENGINE_FINISHED_SESSION_IDS, MAX_ENGINE_SESSION_RECORDS
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.storage import Storage, now_iso

log = logging.getLogger("tinkerrpc.engine")


def training_client_prefix(session_id: str) -> str:
    """What the model ids of a session's training clients start with."""
    return f"{session_id}:train:"


def sampling_session_prefix(session_id: str) -> str:
    """What the ids of a session's sampling sessions start with."""
    return f"{session_id}:sample:"


def session_of(model_id: str) -> str:
    """The session that made a training client."""
    return model_id.split(":train:")[0]


def session_of_sampler(sampler_id: str) -> str:
    """The session that opened a sampling session ("" for sample requests that name none: one share of
    what the engine keeps of them, sampled.py)."""
    return sampler_id.split(":sample:")[0]


@dataclass
class SessionRecord:
    """A session as its client created it; `finish` is how its client finished it (the body of the SDK's
    finish request: {"reason": {"type": ...}, "detail": ...}), None until then, and for ever when it
    stopped without finishing (the engine finished it after its heartbeats stopped)."""

    session_id: str
    created_at: str
    tags: list[str] = field(default_factory=list)
    user_metadata: dict[str, str] = field(default_factory=dict)
    project_id: str | None = None
    display_name: str | None = None
    sdk_version: str | None = None
    finish: dict[str, Any] | None = None


class Sessions:
    """Thread-safe: routes, the compute thread and the sweep all record and finish sessions."""

    def __init__(
        self,
        timeout: float,
        storage: Storage,
        keep: Callable[[str], bool] = lambda session_id: False,
        cap: int = MAX_ENGINE_SESSION_RECORDS,
    ) -> None:
        """`timeout`: seconds without a sign of life after which a session counts as silent. `keep`: whether
        an ended session's record must stay past `cap`, the records kept of other ended sessions."""
        self.timeout = timeout
        self.cap = cap
        self._storage = storage
        self._keep = keep
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}  # session id -> time.monotonic() of its last sign
        self._finished: OrderedDict[str, None] = OrderedDict()

    def open(self, record: SessionRecord | None = None) -> str:
        """A new session, described by `record` (whose id and creation time are set here)."""
        session_id = f"s{secrets.token_hex(6)}"
        described = record or SessionRecord("", "")
        self._storage.put_session(
            dataclasses.asdict(dataclasses.replace(described, session_id=session_id, created_at=now_iso()))
        )
        self.alive(session_id)
        self._forget_past_cap()
        return session_id

    def _forget_past_cap(self) -> None:
        """Forget the oldest records of ended sessions (not running, not kept) while there are more than
        `cap`; a new session is running, so it stays."""
        found = self.records()  # newest first
        excess = len(found) - self.cap
        forgotten: list[str] = []
        for record in reversed(found):
            if len(forgotten) >= excess:
                break
            if not self.is_running(record.session_id) and not self._keep(record.session_id):
                forgotten.append(record.session_id)
        if forgotten:
            self._storage.forget_sessions(forgotten)
            log.info("forgot the records of %d ended sessions, past the cap of %d", len(forgotten), self.cap)

    def records(self) -> list[SessionRecord]:
        """Every recorded session, newest first."""
        found = [SessionRecord(**r) for r in self._storage.list_sessions()]
        return sorted(found, key=lambda r: (r.created_at, r.session_id), reverse=True)

    def record(self, session_id: str) -> SessionRecord | None:
        return next((r for r in self.records() if r.session_id == session_id), None)

    def update(self, record: SessionRecord) -> None:
        self._storage.put_session(dataclasses.asdict(record))

    def is_running(self, session_id: str) -> bool:
        """Whether the session showed a sign of life within the timeout and has not finished."""
        with self._lock:
            seen = self._last_seen.get(session_id)
        return seen is not None and time.monotonic() - seen <= self.timeout

    def alive(self, session_id: str) -> bool:
        """Record a sign of life of a session; False if it has finished. A session this engine never
        saw (it was made before a restart) is adopted."""
        with self._lock:
            if session_id in self._finished:
                return False
            self._last_seen[session_id] = time.monotonic()
            return True

    def require_open(self, session_id: str) -> None:
        """For requests that make something in a session: what a finished session makes would never
        be freed."""
        if not self.alive(session_id):
            raise protocol.BadRequest(f"session {session_id} has finished")

    def silent(self, now: float) -> list[str]:
        """The sessions that showed no sign of life for the timeout before `now` (time.monotonic())."""
        with self._lock:
            return [s for s, seen in self._last_seen.items() if now - seen > self.timeout]

    def mark_finished(self, session_id: str, finish: dict[str, Any] | None = None) -> None:
        """The session is over; `finish`, its client's reason, is recorded unless one was (first wins)."""
        record = self.record(session_id) if finish is not None else None
        if record is not None and record.finish is None:
            self.update(dataclasses.replace(record, finish=finish))
        with self._lock:
            self._last_seen.pop(session_id, None)
            self._finished[session_id] = None
            # Remembered so their heartbeats answer 410 (the SDK then stops its loop).
            while len(self._finished) > MAX_ENGINE_FINISHED_SESSION_IDS:
                self._finished.popitem(last=False)
