"""The engine's on-disk state: training runs and checkpoints under --data-dir, indexed in one JSON file.

Layout:
    <data-dir>/engine_index.json                      runs and checkpoints (written atomically)
    <data-dir>/runs/<model_id>/weights/<name>/        save_state (adapter + optimizer)
    <data-dir>/runs/<model_id>/sampler_weights/<name>/ save_weights_for_sampler (adapter only)
    <data-dir>/runs/<model_id>/external_weights/<name>/ save_weights_external (plain PEFT adapter dir)

`tinker://<model_id>/weights/<name>`, `tinker://<model_id>/sampler_weights/<name>` and
`tinker://<model_id>/external_weights/<name>` resolve to those directories (checkpoint kinds "training",
"sampler" and "external"). A new engine on the same data dir sees every run and checkpoint of the
previous one.

Every path under the data dir is built by `Storage.inside` from checked names (`check_id`,
`validate_checkpoint_name`: no separator, no '..', bounded length, a conservative charset) and must
resolve inside the data dir. What the engine creates there is its owner's alone (0700/0600: the
directory's mode here, the engine process's umask for the rest).
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tempfile
import threading
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal

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
_INDEX_FILE = "engine_index.json"
# How much of a rejected name an error message repeats.
_SHOWN_NAME_CHARS = 80


class UnknownPathError(ValueError):
    """A tinker:// path or checkpoint this engine does not hold."""


class InvalidNameError(ValueError):
    """A name or id that could not be a path segment under the data dir: HTTP 400."""


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


def _write_json_atomically(path: Path, payload: Any) -> None:
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as handle:
            json.dump(payload, handle, indent=1, sort_keys=True)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(tmp_name, path)
    except BaseException:
        Path(tmp_name).unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


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
    """Thread-safe index of runs and checkpoints; every change is persisted before it returns."""

    def __init__(self, data_dir: Path) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        self._root = data_dir.resolve()
        self._lock = threading.Lock()
        self._runs: dict[str, RunRecord] = {}
        self._checkpoints: dict[str, CheckpointRecord] = {}
        index_path = self.inside(_INDEX_FILE)
        if index_path.exists():
            payload = json.loads(index_path.read_text())
            self._runs = {r["model_id"]: RunRecord(**r) for r in payload.get("runs", [])}
            for c in payload.get("checkpoints", []):
                record = CheckpointRecord(**c)
                self._checkpoints[record.tinker_path] = record

    def _persist(self) -> None:
        payload = {
            "runs": [asdict(r) for r in self._runs.values()],
            "checkpoints": [asdict(c) for c in self._checkpoints.values()],
        }
        _write_json_atomically(self.inside(_INDEX_FILE), payload)

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
            self._persist()

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
            self._persist()

    def has_checkpoint(self, tinker_path: str) -> bool:
        with self._lock:
            return tinker_path in self._checkpoints

    def resolve(self, tinker_path: str) -> tuple[CheckpointRecord, Path]:
        """The checkpoint record and directory for a tinker:// path; UnknownPathError if absent."""
        model_id, kind, name = parse_tinker_path(tinker_path)
        with self._lock:
            record = self._checkpoints.get(tinker_path)
        directory = self.checkpoint_dir(model_id, kind, name)
        if record is None or not directory.is_dir():
            raise UnknownPathError(f"no checkpoint at {tinker_path}")
        return record, directory

    def list_checkpoints(self, model_id: str) -> list[CheckpointRecord]:
        with self._lock:
            found = [c for c in self._checkpoints.values() if c.model_id == model_id]
        return sorted(found, key=lambda c: c.created_at)

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord:
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        parse_tinker_path(tinker_path)
        with self._lock:
            record = self._checkpoints.pop(tinker_path, None)
            if record is None:
                raise UnknownPathError(f"no checkpoint at {tinker_path}")
            self._persist()
        shutil.rmtree(self.checkpoint_dir(model_id, record.kind, record.name), ignore_errors=True)
        return record
