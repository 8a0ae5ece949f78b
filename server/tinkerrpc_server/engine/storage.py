"""The engine's on-disk state: training runs and checkpoints under --data-dir, indexed in a journal.

Layout:
    <data-dir>/engine_index.jsonl                     runs and checkpoints: an append-only journal
    <data-dir>/runs/<model_id>/weights/<name>/        save_state (adapter + optimizer)
    <data-dir>/runs/<model_id>/sampler_weights/<name>/ save_weights_for_sampler (adapter only)
    <data-dir>/runs/<model_id>/external_weights/<name>/ save_weights_external (plain PEFT adapter dir)

`tinker://<model_id>/weights/<name>`, `tinker://<model_id>/sampler_weights/<name>` and
`tinker://<model_id>/external_weights/<name>` resolve to those directories (checkpoint kinds "training",
"sampler" and "external"). A new engine on the same data dir sees every run and checkpoint of the
previous one.

The index is a JSON-lines journal: each change appends one fsynced line (a run, a checkpoint, a
deletion), so a step costs the same at step 5 000 as at step 5. At start the journal is replayed (a torn
last line from a crash is ignored) and compacted into one line per live record, and again whenever the
lines appended since outnumber COMPACT_FACTOR times the live records (amortised O(1) per change, and the
file stays within a constant factor of what it describes); checkpoints whose
expiry passed are dropped then, and by the engine's periodic sweep (`expired_checkpoints`).

Every path under the data dir is built by `Storage.inside` from checked names (`check_id`,
`validate_checkpoint_name`: no separator, no '..', bounded length, a conservative charset) and must
resolve inside the data dir. What the engine creates there is its owner's alone (0700/0600: the
directory's mode here, the engine process's umask for the rest).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TextIO

CheckpointKind = Literal["training", "sampler", "external"]

_KIND_SEGMENT: dict[CheckpointKind, str] = {
    "training": "weights",
    "sampler": "sampler_weights",
    "external": "external_weights",
}
_SEGMENT_KIND: dict[str, CheckpointKind] = {v: k for k, v in _KIND_SEGMENT.items()}
_NAME_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# Session, model and sampler ids (`<session>:train:<n>`): one path segment at most.
_ID_PATTERN = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,199}")
_INDEX_FILE = "engine_index.jsonl"
# The journal is rewritten once it holds this many times more appended lines than live records.
COMPACT_FACTOR = 4
_MIN_LINES_BEFORE_COMPACTING = 256
# The whole-file index of earlier versions, read once and replaced by the journal.
_LEGACY_INDEX_FILE = "engine_index.json"
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


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


@dataclass
class RunRecord:
    model_id: str
    base_model: str
    lora_rank: int
    seed: int | None
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    created_at: str
    last_request_time: str
    user_metadata: dict[str, str] = field(default_factory=dict)


@dataclass
class CheckpointRecord:
    model_id: str
    kind: CheckpointKind
    name: str
    created_at: str
    size_bytes: int
    user_metadata: dict[str, str] = field(default_factory=dict)
    # POSIX seconds after which the checkpoint is deleted (the SDK's ttl_seconds); None: kept.
    expires_at: float | None = None
    # An unnamed sampler snapshot: its training client and sampling sessions die with the engine, so a
    # new engine deletes it at start.
    ephemeral: bool = False
    # Published (the SDK's publish_checkpoint_from_tinker_path): listed as public until unpublished.
    public: bool = False

    @property
    def checkpoint_id(self) -> str:
        return f"{_KIND_SEGMENT[self.kind]}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.checkpoint_id}"


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


def fsync_directory(directory: Path) -> None:
    dir_fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


# Sessions are kept as the JSON objects engine/sessions.py makes of its records.
_Index = tuple[dict[str, RunRecord], dict[str, CheckpointRecord], dict[str, dict[str, Any]]]


def _replay(index_path: Path) -> _Index:
    """The runs, checkpoints and sessions a journal describes; a line that does not parse (the torn last
    write of a killed engine) is skipped."""
    runs: dict[str, RunRecord] = {}
    checkpoints: dict[str, CheckpointRecord] = {}
    sessions: dict[str, dict[str, Any]] = {}
    if not index_path.exists():
        return runs, checkpoints, sessions
    with index_path.open() as journal:
        for line in journal:
            try:
                entry = json.loads(line)
            except json.JSONDecodeError:
                continue
            if "run" in entry:
                runs[entry["run"]["model_id"]] = RunRecord(**entry["run"])
            elif "checkpoint" in entry:
                record = CheckpointRecord(**entry["checkpoint"])
                checkpoints[record.tinker_path] = record
            elif "deleted" in entry:
                checkpoints.pop(entry["deleted"], None)
            elif "session" in entry:
                sessions[entry["session"]["session_id"]] = entry["session"]
            elif "forgotten_session" in entry:
                sessions.pop(entry["forgotten_session"], None)
    return runs, checkpoints, sessions


def read_index(data_dir: Path) -> tuple[list[RunRecord], list[CheckpointRecord]]:
    """The runs and checkpoints recorded under an engine's data dir, read without changing anything."""
    runs, checkpoints, _ = _replay(data_dir / _INDEX_FILE)
    return list(runs.values()), list(checkpoints.values())


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
    """Thread-safe index of runs and checkpoints; every change is in the journal before it returns."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root = data_dir.resolve()
        self._lock = threading.Lock()
        index_path = self.inside(_INDEX_FILE)
        self._runs, self._checkpoints, self._sessions = _replay(index_path)
        legacy_index = self.inside(_LEGACY_INDEX_FILE)
        if legacy_index.exists():
            self._read_legacy_index(legacy_index)
        expired = self._pop_expired(time.time())
        ephemeral = [c for c in self._checkpoints.values() if c.ephemeral]
        for record in ephemeral:
            del self._checkpoints[record.tinker_path]
        self._index_path = index_path
        self._journal: TextIO | None = None
        self._appended = 0
        self._compact()
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
            for segment in _KIND_SEGMENT.values():
                with contextlib.suppress(OSError):  # not empty, or not there
                    (run_dir / segment).rmdir()
            with contextlib.suppress(OSError):
                run_dir.rmdir()

    def _read_legacy_index(self, path: Path) -> None:
        """A data dir of an engine before the journal: its whole-file index, taken over once."""
        payload = json.loads(path.read_text())
        for run in payload.get("runs", []):
            self._runs.setdefault(run["model_id"], RunRecord(**run))
        for checkpoint in payload.get("checkpoints", []):
            record = CheckpointRecord(**checkpoint)
            self._checkpoints.setdefault(record.tinker_path, record)

    def _compact(self) -> None:
        """Rewrite the journal as one line per live record, atomically, and append to the new one."""
        index_path = self._index_path
        fd, tmp_name = tempfile.mkstemp(dir=index_path.parent, prefix=index_path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                for run in self._runs.values():
                    handle.write(json.dumps({"run": asdict(run)}) + "\n")
                for checkpoint in self._checkpoints.values():
                    handle.write(json.dumps({"checkpoint": asdict(checkpoint)}) + "\n")
                for session in self._sessions.values():
                    handle.write(json.dumps({"session": session}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, index_path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        fsync_directory(index_path.parent)
        if self._journal is not None:
            self._journal.close()
        self._journal = index_path.open("a")
        self._appended = 0

    def _append(self, entry: dict[str, Any]) -> None:
        """One journal line, on disk before the change is acknowledged (caller holds the lock)."""
        assert self._journal is not None
        self._journal.write(json.dumps(entry) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self._appended += 1
        live = len(self._runs) + len(self._checkpoints) + len(self._sessions)
        if self._appended > max(_MIN_LINES_BEFORE_COMPACTING, COMPACT_FACTOR * live):
            self._compact()

    def close(self) -> None:
        with self._lock:
            if self._journal is not None:
                self._journal.close()

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
        return self.inside("runs", model_id, _KIND_SEGMENT[kind], name)

    def put_run(self, record: RunRecord) -> None:
        with self._lock:
            self._runs[record.model_id] = record
            self._append({"run": asdict(record)})

    def touch_run(self, model_id: str) -> None:
        """Record activity in memory; persisted with the next change (no disk write per step)."""
        with self._lock:
            run = self._runs.get(model_id)
            if run is not None:
                run.last_request_time = now_iso()

    def get_run(self, model_id: str) -> RunRecord:
        with self._lock:
            run = self._runs.get(model_id)
        if run is None:
            raise UnknownPathError(f"unknown training run {model_id!r}")
        return run

    def list_runs(self) -> list[RunRecord]:
        with self._lock:
            return sorted(self._runs.values(), key=lambda r: r.created_at, reverse=True)

    def add_checkpoint(self, record: CheckpointRecord) -> None:
        with self._lock:
            self._checkpoints[record.tinker_path] = record
            run = self._runs.get(record.model_id)
            if run is not None:
                run.last_request_time = record.created_at
            self._append({"checkpoint": asdict(record)})

    def has_checkpoint(self, tinker_path: str) -> bool:
        with self._lock:
            return tinker_path in self._checkpoints

    def resolve(self, tinker_path: str) -> tuple[CheckpointRecord, Path]:
        """The checkpoint record and directory for a tinker:// path; UnknownPathError if absent."""
        model_id, kind, name = parse_tinker_path(tinker_path)
        with self._lock:
            record = self._checkpoints.get(tinker_path)
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
                for c in self._checkpoints.values()
                if c.model_id == model_id and (c.expires_at is None or c.expires_at > now)
            ]
        return sorted(found, key=lambda c: c.created_at)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord:
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        parse_tinker_path(tinker_path)
        with self._lock:
            record = self._checkpoints.pop(tinker_path, None)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            self._append({"deleted": tinker_path})
        self._remove_files(record)
        return record

    def set_expiry(self, tinker_path: str, expires_at: float | None) -> CheckpointRecord:
        """Give a checkpoint an expiry (None: it is kept until deleted)."""
        parse_tinker_path(tinker_path)
        with self._lock:
            record = self._checkpoints.get(tinker_path)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            record.expires_at = expires_at
            self._append({"checkpoint": asdict(record)})
        return record

    def set_public(self, tinker_path: str, public: bool) -> CheckpointRecord:
        """Publish or unpublish a checkpoint; ConflictError when it already is what was asked."""
        self.resolve(tinker_path)
        with self._lock:
            record = self._checkpoints.get(tinker_path)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            if record.public == public:
                raise ConflictError(f"{tinker_path} is already {'public' if public else 'private'}")
            record.public = public
            self._append({"checkpoint": asdict(record)})
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
            if run.model_id in self._runs:
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
        self.put_run(run)
        self.add_checkpoint(copy)
        return copy

    def put_session(self, record: dict[str, Any]) -> None:
        """Record a session (a JSON object with its "session_id"), replacing what was recorded of it."""
        with self._lock:
            self._sessions[record["session_id"]] = record
            self._append({"session": record})

    def forget_sessions(self, session_ids: list[str]) -> None:
        """Drop the records of these sessions (past the cap of sessions.py)."""
        with self._lock:
            for session_id in session_ids:
                if self._sessions.pop(session_id, None) is not None:
                    self._append({"forgotten_session": session_id})

    def list_sessions(self) -> list[dict[str, Any]]:
        with self._lock:
            return list(self._sessions.values())

    def delete_expired(self, now: float) -> list[CheckpointRecord]:
        """Delete every checkpoint whose expiry has passed; the deleted records."""
        with self._lock:
            expired = self._pop_expired(now)
            for record in expired:
                self._append({"deleted": record.tinker_path})
        for record in expired:
            self._remove_files(record)
        return expired

    def _pop_expired(self, now: float) -> list[CheckpointRecord]:
        expired = [c for c in self._checkpoints.values() if c.expires_at is not None and c.expires_at <= now]
        for record in expired:
            del self._checkpoints[record.tinker_path]
        return expired

    def _remove_files(self, record: CheckpointRecord) -> None:
        shutil.rmtree(self.checkpoint_dir(record.model_id, record.kind, record.name), ignore_errors=True)
