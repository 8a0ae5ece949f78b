"""The engine's on-disk state: training runs and checkpoints under --data-dir, and the index of them.

Layout:
    <data-dir>/engine_index.jsonl                     runs, checkpoints, sessions: a journal (index.py)
    <data-dir>/runs/<model_id>/weights/<name>/        save_state (adapter + optimizer)
    <data-dir>/runs/<model_id>/sampler_weights/<name>/ save_weights_for_sampler (adapter only)
    <data-dir>/runs/<model_id>/external_weights/<name>/ save_weights_external (plain PEFT adapter dir)

`tinker://<model_id>/weights/<name>`, `tinker://<model_id>/sampler_weights/<name>` and
`tinker://<model_id>/external_weights/<name>` resolve to those directories (checkpoint kinds "training",
"sampler" and "external"). A new engine on the same data dir sees every run and checkpoint of the
previous one. Checkpoints whose expiry passed are dropped at start and by the engine's periodic sweep
(`delete_expired`).

Run records are bounded (`forget_idle_runs`): every training client is a run, so a service that rebuilds
its training clients would otherwise grow the index and every listing for ever. A run with no checkpoint
and no live training client is forgotten once idle for MAX_ENGINE_IDLE_RUN_SECONDS, and the oldest such
runs while there are more than MAX_ENGINE_RUN_RECORDS; a forgotten run is unknown (404) from then on.

Every path under the data dir is built by `Storage.inside` from checked names (`check_id`,
`validate_checkpoint_name`: no separator, no '..', bounded length, a conservative charset) and must
resolve inside the data dir. What the engine creates there is its owner's alone (0700/0600: the
directory's mode here, the engine process's umask for the rest).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from datetime import datetime
from pathlib import Path
from typing import Any

from tinkerrpc.contract.limits import MAX_ENGINE_IDLE_RUN_SECONDS, MAX_ENGINE_RUN_RECORDS

# The index's records and helpers, which the engine's other modules import from here.
from tinkerrpc_server.engine.index import (
    INDEX_FILE,
    KIND_SEGMENT,
    LEGACY_INDEX_FILE,
    Index,
)
from tinkerrpc_server.engine.index import CheckpointKind as CheckpointKind
from tinkerrpc_server.engine.index import CheckpointRecord as CheckpointRecord
from tinkerrpc_server.engine.index import RunRecord as RunRecord
from tinkerrpc_server.engine.index import fsync_path as fsync_path
from tinkerrpc_server.engine.index import now_iso as now_iso

log = logging.getLogger("tinkerrpc.engine")

_SEGMENT_KIND: dict[str, CheckpointKind] = {v: k for k, v in KIND_SEGMENT.items()}
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Session, model and sampler ids (`<session>:train:<n>`): one path segment at most.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
# In the name of a save's staging directory (compute/state_io.py): `.<name>.tmp-<random>`.
_STAGING_MARK = ".tmp-"
# How much of a rejected name an error message repeats.
_SHOWN_NAME_CHARS = 80


class UnknownPathError(ValueError):
    """A tinker:// path or checkpoint this engine does not hold."""


class InvalidNameError(ValueError):
    """A name or id that could not be a path segment under the data dir: HTTP 400."""


class ConflictError(ValueError):
    """A change the record's state contradicts (publishing a public checkpoint, making a run that
    exists): HTTP 400, not 409, which the SDK would retry for 5 minutes."""


def _shown(name: str) -> str:
    return repr(name if len(name) <= _SHOWN_NAME_CHARS else f"{name[:_SHOWN_NAME_CHARS]}...")


def check_id(what: str, value: str) -> str:
    """`value` when it is a valid session, model or sampler id, else InvalidNameError."""
    if _ID_PATTERN.fullmatch(value) is None or ".." in value:
        raise InvalidNameError(
            f"{what} {_shown(value)} is invalid: use 1-200 letters, digits, '.', '_', ':' or '-', "
            "starting with a letter or digit, without '..'"
        )
    return value


def validate_checkpoint_name(name: str) -> None:
    if _NAME_PATTERN.fullmatch(name) is None or ".." in name:
        raise InvalidNameError(
            f"checkpoint name {_shown(name)} is invalid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit, without '..'"
        )


def parse_tinker_path(path: str) -> tuple[str, CheckpointKind, str]:
    """(model_id, kind, name) of `tinker://<model_id>/<weights|sampler_weights|external_weights>/<name>`."""
    if not path.startswith("tinker://"):
        raise UnknownPathError(f"{path!r} is not a tinker:// path")
    parts = path[len("tinker://") :].split("/")
    if len(parts) != 3 or parts[1] not in _SEGMENT_KIND or not parts[0] or not parts[2]:
        raise UnknownPathError(
            f"{_shown(path)} is not of the form tinker://<model_id>/weights/<name>, "
            ".../sampler_weights/<name> or .../external_weights/<name>"
        )
    validate_checkpoint_name(parts[2])
    return check_id("model_id", parts[0]), _SEGMENT_KIND[parts[1]], parts[2]


def read_index(data_dir: Path) -> tuple[list[RunRecord], list[CheckpointRecord]]:
    """The runs and checkpoints recorded under an engine's data dir, read without changing anything."""
    index = Index(data_dir / INDEX_FILE)
    return list(index.runs.values()), list(index.checkpoints.values())


def directory_size(path: Path) -> int:
    return sum(p.stat().st_size for p in path.rglob("*") if p.is_file())


def regular_files(directory: Path) -> list[str]:
    """The regular files under `directory`, as sorted '/'-separated relative paths; symlinks are skipped
    (and symlinked directories are not entered)."""
    found = []
    for root, _, files in os.walk(directory):
        for file in files:
            path = Path(root) / file
            if path.is_file() and not path.is_symlink():
                found.append(path.relative_to(directory).as_posix())
    return sorted(found)


def check_relative_path(relative: str) -> None:
    """UnknownPathError unless `relative` is a plain relative path: no '..', '.', empty parts or leading '/'."""
    parts = relative.split("/")
    if not relative or "\\" in relative or "\0" in relative or any(p in ("", ".", "..") for p in parts):
        raise UnknownPathError(f"no file {relative!r} here")


def file_inside(directory: Path, relative: str) -> Path:
    """The regular file at `relative` inside `directory`, or UnknownPathError: never a path that leaves it,
    through '..', an absolute path or a symlink anywhere along the way."""
    check_relative_path(relative)
    path = directory
    for part in relative.split("/"):
        path = path / part
        if path.is_symlink():
            raise UnknownPathError(f"no file {relative!r} here")
    if not path.is_file() or not path.resolve().is_relative_to(directory.resolve()):
        raise UnknownPathError(f"no file {relative!r} here")
    return path


class Storage:
    """Thread-safe index of runs, checkpoints and sessions; every change is in the journal before it
    returns. `run_cap` and `run_max_idle_seconds` bound the run records (`forget_idle_runs`)."""

    def __init__(
        self,
        data_dir: Path,
        run_cap: int = MAX_ENGINE_RUN_RECORDS,
        run_max_idle_seconds: float = MAX_ENGINE_IDLE_RUN_SECONDS,
    ) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root = data_dir.resolve()
        self._lock = threading.Lock()
        self.run_cap, self.run_max_idle_seconds = run_cap, run_max_idle_seconds
        # Changes before the first compaction are only in memory: that compaction writes them.
        self._index = Index(self.inside(INDEX_FILE))
        legacy_index = self.inside(LEGACY_INDEX_FILE)
        if legacy_index.exists():
            self._index.take_legacy(legacy_index)
        expired = self._pop_expired(time.time())
        ephemeral = [c for c in self._index.checkpoints.values() if c.ephemeral]
        for record in ephemeral:
            self._index.delete_checkpoint(record.tinker_path)
        # No training client outlives its engine: every run without a checkpoint is idle now.
        self._forget_idle_runs(lambda model_id: False, time.time())
        self._index.compact()
        legacy_index.unlink(missing_ok=True)
        for record in [*expired, *ephemeral]:
            self._remove_files(record)
        self._remove_leftovers()

    def _remove_leftovers(self) -> None:
        """At start, nothing else writes here yet: remove the staging directory of a save a kill cut short
        (`.<name>.tmp-*`, never published) and the directories left empty under runs/ (a restarted
        service's training clients are new runs, and the old run's checkpoints are pruned one by one).
        A save makes its directories again."""
        runs = self.inside("runs")
        if not runs.is_dir():
            return
        for staging in runs.glob(f"*/*/.*{_STAGING_MARK}*"):
            shutil.rmtree(staging, ignore_errors=True)
        for run_dir in runs.iterdir():
            for segment in KIND_SEGMENT.values():
                with contextlib.suppress(OSError):  # not empty, or not there
                    (run_dir / segment).rmdir()
            with contextlib.suppress(OSError):
                run_dir.rmdir()

    def close(self) -> None:
        with self._lock:
            self._index.close()

    def inside(self, *parts: str) -> Path:
        """The path of `parts` under the data dir, refused (UnknownPathError) unless it resolves inside
        it: the one way paths under the data dir are built, so no name and no symlink leads out."""
        path = self.data_dir.joinpath(*parts)
        if not path.resolve().is_relative_to(self._root):
            raise UnknownPathError(f"{_shown('/'.join(parts))} is outside the engine's data dir")
        return path

    def checkpoint_dir(self, model_id: str, kind: CheckpointKind, name: str) -> Path:
        check_id("model_id", model_id)
        validate_checkpoint_name(name)
        return self.inside("runs", model_id, KIND_SEGMENT[kind], name)

    # ---- training runs ----

    def put_run(self, record: RunRecord) -> None:
        with self._lock:
            self._index.put_run(record)

    def touch_run(self, model_id: str) -> None:
        """Record activity in memory; persisted with the next change (no disk write per step)."""
        with self._lock:
            run = self._index.runs.get(model_id)
            if run is not None:
                run.last_request_time = now_iso()

    def get_run(self, model_id: str) -> RunRecord:
        with self._lock:
            run = self._index.runs.get(model_id)
        if run is None:
            raise UnknownPathError(f"unknown training run {model_id!r}")
        return run

    def list_runs(self) -> list[RunRecord]:
        with self._lock:
            return sorted(self._index.runs.values(), key=lambda r: r.created_at, reverse=True)

    def forget_idle_runs(self, live: Callable[[str], bool]) -> list[str]:
        """Forget the records of idle runs: those with no checkpoint and no live training client (`live`),
        each once its last request is more than `run_max_idle_seconds` old, and the least recently used
        others while there are more than `run_cap` runs (the cap gives way to runs that are not idle).
        The forgotten model ids. Call it where no run is between its record and its training client
        (the compute thread): such a run looks idle."""
        with self._lock:
            forgotten = self._forget_idle_runs(live, time.time())
        if forgotten:
            log.info(
                "forgot %d idle training runs (no checkpoint, no live client; idle %.0f s, or past %d runs)",
                len(forgotten),
                self.run_max_idle_seconds,
                self.run_cap,
            )
        return forgotten

    def _forget_idle_runs(self, live: Callable[[str], bool], now: float) -> list[str]:
        with_checkpoints = {c.model_id for c in self._index.checkpoints.values()}
        idle = sorted(
            (
                (datetime.fromisoformat(run.last_request_time).timestamp(), run.model_id)
                for run in self._index.runs.values()
                if run.model_id not in with_checkpoints and not live(run.model_id)
            ),
        )
        excess = len(self._index.runs) - self.run_cap
        forgotten = [
            model_id
            for rank, (last_request, model_id) in enumerate(idle)
            if rank < excess or now - last_request > self.run_max_idle_seconds
        ]
        for model_id in forgotten:
            self._index.forget_run(model_id)
        return forgotten

    # ---- checkpoints ----

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        with self._lock:
            self._add_checkpoint(record)

    def _add_checkpoint(self, record: CheckpointRecord) -> None:
        self._index.put_checkpoint(record)
        run = self._index.runs.get(record.model_id)
        if run is not None:
            run.last_request_time = record.created_at

    def has_checkpoint(self, tinker_path: str) -> bool:
        with self._lock:
            return tinker_path in self._index.checkpoints

    def resolve(self, tinker_path: str) -> tuple[CheckpointRecord, Path]:
        """The checkpoint record and directory for a tinker:// path; UnknownPathError if absent."""
        model_id, kind, name = parse_tinker_path(tinker_path)
        with self._lock:
            record = self._index.checkpoints.get(tinker_path)
        directory = self.checkpoint_dir(model_id, kind, name)
        expired = record is not None and record.expires_at is not None and record.expires_at <= time.time()
        if record is None or expired or not directory.is_dir():
            raise UnknownPathError(f"no checkpoint at {tinker_path}")
        return record, directory

    def list_checkpoints(self, model_id: str) -> list[CheckpointRecord]:
        now = time.time()
        with self._lock:
            found = [
                c
                for c in self._index.checkpoints.values()
                if c.model_id == model_id and (c.expires_at is None or c.expires_at > now)
            ]
        return sorted(found, key=lambda c: c.created_at)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord:
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        parse_tinker_path(tinker_path)
        with self._lock:
            record = self._index.delete_checkpoint(tinker_path)
        if record is None:
            raise UnknownPathError(f"no checkpoint at {tinker_path}")
        self._remove_files(record)
        return record

    def set_expiry(self, tinker_path: str, expires_at: float | None) -> CheckpointRecord:
        """Give a checkpoint an expiry (None: it is kept until deleted)."""
        parse_tinker_path(tinker_path)
        with self._lock:
            record = self._index.checkpoints.get(tinker_path)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            record = replace(record, expires_at=expires_at)
            self._index.put_checkpoint(record)
        return record

    def set_public(self, tinker_path: str, public: bool) -> CheckpointRecord:
        """Publish or unpublish a checkpoint; ConflictError when it already is what was asked."""
        self.resolve(tinker_path)
        with self._lock:
            record = self._index.checkpoints.get(tinker_path)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            if record.public == public:
                raise ConflictError(f"{tinker_path} is already {'public' if public else 'private'}")
            record = replace(record, public=public)
            self._index.put_checkpoint(record)
        return record

    def link_checkpoint(self, source_path: str, run: RunRecord, expires_at: float | None) -> CheckpointRecord:
        """A copy of the checkpoint at `source_path` in the new run `run` (recorded here), under the same
        kind and name: its files are hard links to the source's, so no bytes are duplicated and either
        one can be deleted without the other (ConflictError: `run` exists already)."""
        source, source_dir = self.resolve(source_path)
        copy = CheckpointRecord(
            run.model_id, source.kind, source.name, now_iso(), source.size_bytes, {}, expires_at
        )
        target = self.checkpoint_dir(run.model_id, copy.kind, copy.name)
        with self._lock:
            if run.model_id in self._index.runs:
                raise ConflictError(f"training run {run.model_id} already exists")
        target.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{copy.name}{_STAGING_MARK}", dir=target.parent))
        try:
            for relative in regular_files(source_dir):
                destination = staging / relative
                destination.parent.mkdir(parents=True, exist_ok=True)
                os.link(source_dir / relative, destination)
            staging.rename(target)
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        with self._lock:  # together: a run without its checkpoint would look idle (forget_idle_runs)
            self._index.put_run(run)
            self._add_checkpoint(copy)
        return copy

    def delete_expired(self, now: float) -> list[CheckpointRecord]:
        """Delete every checkpoint whose expiry has passed; the deleted records."""
        with self._lock:
            expired = self._pop_expired(now)
        for record in expired:
            self._remove_files(record)
        return expired

    def _pop_expired(self, now: float) -> list[CheckpointRecord]:
        expired = [
            c for c in self._index.checkpoints.values() if c.expires_at is not None and c.expires_at <= now
        ]
        for record in expired:
            self._index.delete_checkpoint(record.tinker_path)
        return expired

    def _remove_files(self, record: CheckpointRecord) -> None:
        shutil.rmtree(self.checkpoint_dir(record.model_id, record.kind, record.name), ignore_errors=True)

    # ---- sessions (engine/sessions.py) ----

    def put_session(self, record: dict[str, Any]) -> None:
        """Record a session (a JSON object with its "session_id"), replacing what was recorded of it."""
        with self._lock:
            self._index.put_session(record)

    def forget_sessions(self, session_ids: list[str]) -> None:
        """Drop the records of these sessions (past the cap of sessions.py)."""
        with self._lock:
            for session_id in session_ids:
                self._index.forget_session(session_id)

    def list_sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._index.sessions.values())
