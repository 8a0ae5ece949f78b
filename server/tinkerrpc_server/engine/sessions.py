"""The engine's tinker sessions: which are alive, when each last showed a sign of life, which have
finished. What a session made (training clients `<session>:train:<n>`, sampling sessions
`<session>:sample:<n>`) is freed by the engine when it finishes (core.Engine.finish_session)."""

from __future__ import annotations

import secrets
import threading
import time
from collections import OrderedDict

from tinkerrpc_server.engine import protocol

# Finished session ids remembered so their heartbeats answer 410 (the SDK then stops its loop).
FINISHED_SESSIONS_REMEMBERED = 4096


def training_client_prefix(session_id: str) -> str:
    """What the model ids of a session's training clients start with."""
    return f"{session_id}:train:"


def sampling_session_prefix(session_id: str) -> str:
    """What the ids of a session's sampling sessions start with."""
    return f"{session_id}:sample:"


def session_of(model_id: str) -> str:
    """The session that made a training client."""
    return model_id.split(":train:")[0]


class Sessions:
    """Thread-safe: routes, the compute thread and the sweep all record and finish sessions."""

    def __init__(self, timeout: float) -> None:
        """`timeout`: seconds without a sign of life after which a session counts as silent."""
        self.timeout = timeout
        self._lock = threading.Lock()
        self._last_seen: dict[str, float] = {}  # session id -> time.monotonic() of its last sign
        self._finished: OrderedDict[str, None] = OrderedDict()

    def open(self) -> str:
        session_id = f"s{secrets.token_hex(6)}"
        self.alive(session_id)
        return session_id

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

    def mark_finished(self, session_id: str) -> None:
        with self._lock:
            self._last_seen.pop(session_id, None)
            self._finished[session_id] = None
            while len(self._finished) > FINISHED_SESSIONS_REMEMBERED:
                self._finished.popitem(last=False)
