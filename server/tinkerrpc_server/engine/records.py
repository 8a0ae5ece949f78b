"""The engine's records as the SDK's REST calls read and change them: its sessions (with what each made),
checkpoint copies and publication, and the bytes its checkpoints take.

A room of the engine (core.Engine.records) over its index (storage), its sessions and its sampler
ledger; every change is in the index before it returns.
"""

from __future__ import annotations

import dataclasses
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG as stat_is_regular

from tinkerrpc_server.engine.age_export import encrypt_in_place
from tinkerrpc_server.engine.sessions import (
    SessionRecord,
    Sessions,
    sampling_session_prefix,
    session_of,
    training_client_prefix,
)
from tinkerrpc_server.engine.snapshots import SamplerLedger
from tinkerrpc_server.engine.storage import (
    CheckpointRecord,
    Storage,
    UnknownPathError,
    directory_size,
    now_iso,
)

# Copies remembered by their client's X-Idempotency-Key, so a retried copy answers the first one's path.
COPIES_REMEMBERED = 1024


@dataclass(frozen=True)
class SessionView:
    """A session's record and what it made: its training runs, open sampling sessions, checkpoints."""

    record: SessionRecord
    running: bool
    training_run_ids: list[str]
    sampler_ids: list[str]
    checkpoints: list[CheckpointRecord]


@dataclass(frozen=True)
class StorageUse:
    """The checkpoints of one project (None: sessions without one) and the bytes their files hold."""

    project_id: str | None
    checkpoint_count: int
    size_bytes: int


class Records:
    """Thread-safe through the rooms it composes (storage, sessions, ledger each lock their own state)."""

    def __init__(self, storage: Storage, sessions: Sessions, ledger: SamplerLedger) -> None:
        self._storage = storage
        self._sessions = sessions
        self._ledger = ledger
        self._copies: OrderedDict[str, str] = OrderedDict()  # idempotency key -> the copy's tinker path
        self._copying = threading.Lock()  # a retry waits for its first copy instead of making a second

    # ---- sessions ----

    def open_session(self, record: SessionRecord) -> str:
        return self._sessions.open(record)

    def session_ids(self) -> list[str]:
        """Every recorded session's id, newest first."""
        return [record.session_id for record in self._sessions.records()]

    def sessions(self) -> list[SessionView]:
        """Every recorded session, newest first."""
        runs = self._runs_by_session()
        return [self._view(record, runs) for record in self._sessions.records()]

    def session(self, session_id: str) -> SessionView:
        record = self._sessions.record(session_id)
        if record is None:
            raise UnknownPathError(f"unknown session {session_id!r}")
        return self._view(record, self._runs_by_session())

    def sessions_in_project(self, project_id: str) -> set[str]:
        return {r.session_id for r in self._sessions.records() if r.project_id == project_id}

    def set_project(self, session_id: str, project_id: str) -> None:
        self._sessions.update(dataclasses.replace(self.session(session_id).record, project_id=project_id))

    def _runs_by_session(self) -> dict[str, list[str]]:
        runs: dict[str, list[str]] = {}
        for run in self._storage.list_runs():
            runs.setdefault(session_of(run.model_id), []).append(run.model_id)
        return runs

    def _view(self, record: SessionRecord, runs_by_session: dict[str, list[str]]) -> SessionView:
        runs = sorted(runs_by_session.get(record.session_id, []))
        checkpoints = [c for run in runs for c in self._storage.list_checkpoints(run)]
        return SessionView(
            record,
            record.finish is None and self._sessions.is_running(record.session_id),
            runs,
            self._ledger.sampler_ids(sampling_session_prefix(record.session_id)),
            checkpoints,
        )

    # ---- checkpoints ----

    def checkpoint_dir(self, tinker_path: str) -> Path:
        """The directory of the checkpoint at `tinker_path` (UnknownPathError: none there)."""
        return self._storage.resolve(tinker_path)[1]

    def copy_checkpoint(
        self,
        source_path: str,
        target: tuple[str, int] | None,
        project_id: str | None,
        expires_at: float | None,
        idempotency_key: str | None,
    ) -> str:
        """Copy a checkpoint into a new training run (which no client trains) and answer its path. The run
        is `<session>:train:<model_seq_id>` of the open session `target`, else run 0 of a new session
        in `project_id`, finished at once. A key seen before answers the earlier copy's path."""
        with self._copying:
            if idempotency_key is not None and idempotency_key in self._copies:
                return self._copies[idempotency_key]
            path = self._copy(source_path, target, project_id, expires_at)
            if idempotency_key is not None:
                self._copies[idempotency_key] = path
                while len(self._copies) > COPIES_REMEMBERED:
                    self._copies.popitem(last=False)
            return path

    def _copy(
        self,
        source_path: str,
        target: tuple[str, int] | None,
        project_id: str | None,
        expires_at: float | None,
    ) -> str:
        source, _ = self._storage.resolve(source_path)
        source_run = self._storage.get_run(source.model_id)
        if target is None:
            session_id = self.open_session(SessionRecord("", "", project_id=project_id))
            self._sessions.mark_finished(
                session_id, {"reason": {"type": "success"}, "detail": "copy_weights"}
            )
            model_id = f"{training_client_prefix(session_id)}0"
        else:
            session_id, model_seq_id = target
            if self._sessions.record(session_id) is None:
                raise UnknownPathError(f"unknown session {session_id!r}")
            self._sessions.require_open(session_id)
            model_id = f"{training_client_prefix(session_id)}{model_seq_id}"
        stamp = now_iso()
        run = dataclasses.replace(
            source_run, model_id=model_id, created_at=stamp, last_request_time=stamp, user_metadata={}
        )
        return self._storage.link_checkpoint(source_path, run, expires_at).tinker_path

    def encrypt_external(self, tinker_path: str, recipients: list[object]) -> CheckpointRecord:
        """Encrypt an external-weights checkpoint's files to age `recipients` (age_export), and record
        the bytes it then holds."""
        record, directory = self._storage.resolve(tinker_path)
        encrypt_in_place(directory, recipients)
        record.size_bytes = directory_size(directory)
        self._storage.add_checkpoint(record)
        return record

    def set_public(self, tinker_path: str, public: bool) -> CheckpointRecord:
        return self._storage.set_public(tinker_path, public)

    def storage_use(self) -> list[StorageUse]:
        """The live checkpoints' bytes by project: the files under their directories, each stored file
        counted once (a copy's hard links share the source's bytes)."""
        projects = {r.session_id: r.project_id for r in self._sessions.records()}
        seen: set[tuple[int, int]] = set()
        totals: dict[str | None, tuple[int, int]] = {}
        for run in self._storage.list_runs():
            project = projects.get(session_of(run.model_id))
            for checkpoint in self._storage.list_checkpoints(run.model_id):
                size = _unseen_bytes(
                    self._storage.checkpoint_dir(run.model_id, checkpoint.kind, checkpoint.name), seen
                )
                count, total = totals.get(project, (0, 0))
                totals[project] = (count + 1, total + size)
        return [StorageUse(project, count, size) for project, (count, size) in totals.items()]


def _unseen_bytes(directory: Path, seen: set[tuple[int, int]]) -> int:
    """The bytes of the regular files under `directory` whose (device, inode) is not in `seen` (added)."""
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            stat = os.lstat(os.path.join(root, name))
            if stat_is_regular(stat.st_mode) and (stat.st_dev, stat.st_ino) not in seen:
                seen.add((stat.st_dev, stat.st_ino))
                total += stat.st_size
    return total
