"""The engine's index: the records of its training runs, checkpoints and sessions, and the journal on disk
(`<data-dir>/engine_index.jsonl`) that keeps them across restarts. storage.py owns the one Index of an
engine and its lock; callers import the records from there.

The journal is JSON lines: each change appends one fsynced line (a run, a checkpoint, a deletion, a
forgotten record), so a step costs the same at step 5 000 as at step 5. Opening it replays every line (a
torn last line from a crash is ignored); it is compacted into one line per live record at start, and again
whenever the lines appended since outnumber COMPACT_FACTOR times the live records (amortised O(1) per
change, and the file stays within a constant factor of what it describes).
"""

from __future__ import annotations

import json
import os
import tempfile
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Literal, TextIO

CheckpointKind = Literal["training", "sampler", "external"]

# The path segment of each checkpoint kind, in tinker:// paths and under runs/<model_id>/.
KIND_SEGMENT: dict[CheckpointKind, str] = {
    "training": "weights",
    "sampler": "sampler_weights",
    "external": "external_weights",
}
INDEX_FILE = "engine_index.jsonl"
# The whole-file index of earlier versions, read once and replaced by the journal.
LEGACY_INDEX_FILE = "engine_index.json"
# The journal is rewritten once it holds this many times more appended lines than live records.
COMPACT_FACTOR = 4
_MIN_LINES_BEFORE_COMPACTING = 256


def now_iso() -> str:
    return datetime.now(timezone.utc).isoformat()


def fsync_path(path: Path) -> None:
    """Flush a file's data, or a directory's entries, to disk."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


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
        return f"{KIND_SEGMENT[self.kind]}/{self.name}"

    @property
    def tinker_path(self) -> str:
        return f"tinker://{self.model_id}/{self.checkpoint_id}"


class Index:
    """The live records and the journal that holds them. Not thread-safe: its owner holds a lock. Its
    owner compacts it once opened (start: what replay and the start's own changes left)."""

    def __init__(self, path: Path) -> None:
        """The records the journal at `path` describes; nothing is written until `compact`. A line that
        does not parse (the torn last write of a killed engine) is skipped."""
        self.path = path
        self.runs: dict[str, RunRecord] = {}
        self.checkpoints: dict[str, CheckpointRecord] = {}  # by tinker path
        # Sessions are kept as the JSON objects engine/sessions.py makes of its records.
        self.sessions: dict[str, dict[str, Any]] = {}
        self._journal: TextIO | None = None
        self._appended = 0
        if not path.exists():
            return
        with path.open() as journal:
            for line in journal:
                try:
                    entry = json.loads(line)
                except json.JSONDecodeError:
                    continue
                self._apply(entry)

    def _apply(self, entry: dict[str, Any]) -> None:
        """One journal line's change: the one place each kind of line is given its meaning."""
        if "run" in entry:
            self.runs[entry["run"]["model_id"]] = RunRecord(**entry["run"])
        elif "checkpoint" in entry:
            record = CheckpointRecord(**entry["checkpoint"])
            self.checkpoints[record.tinker_path] = record
        elif "deleted" in entry:
            self.checkpoints.pop(entry["deleted"], None)
        elif "session" in entry:
            self.sessions[entry["session"]["session_id"]] = entry["session"]
        elif "forgotten_session" in entry:
            self.sessions.pop(entry["forgotten_session"], None)
        elif "forgotten_run" in entry:
            self.runs.pop(entry["forgotten_run"], None)

    def take_legacy(self, path: Path) -> None:
        """A data dir of an engine before the journal: its whole-file index, taken over once."""
        payload = json.loads(path.read_text())
        for run in payload.get("runs", []):
            self.runs.setdefault(run["model_id"], RunRecord(**run))
        for checkpoint in payload.get("checkpoints", []):
            record = CheckpointRecord(**checkpoint)
            self.checkpoints.setdefault(record.tinker_path, record)

    def put_run(self, record: RunRecord) -> None:
        self._change({"run": asdict(record)})

    def put_checkpoint(self, record: CheckpointRecord) -> None:
        """Record a checkpoint, or what changed of one (its expiry, its public flag)."""
        self._change({"checkpoint": asdict(record)})

    def put_session(self, record: dict[str, Any]) -> None:
        self._change({"session": record})

    def delete_checkpoint(self, tinker_path: str) -> CheckpointRecord | None:
        """The deleted record; None (and nothing written) when there was none."""
        record = self.checkpoints.get(tinker_path)
        if record is not None:
            self._change({"deleted": tinker_path})
        return record

    def forget_session(self, session_id: str) -> None:
        if session_id in self.sessions:
            self._change({"forgotten_session": session_id})

    def forget_run(self, model_id: str) -> None:
        if model_id in self.runs:
            self._change({"forgotten_run": model_id})

    def compact(self) -> None:
        """Rewrite the journal as one line per live record, atomically, and append to the new one."""
        fd, tmp_name = tempfile.mkstemp(dir=self.path.parent, prefix=self.path.name, suffix=".tmp")
        try:
            with os.fdopen(fd, "w") as handle:
                for run in self.runs.values():
                    handle.write(json.dumps({"run": asdict(run)}) + "\n")
                for checkpoint in self.checkpoints.values():
                    handle.write(json.dumps({"checkpoint": asdict(checkpoint)}) + "\n")
                for session in self.sessions.values():
                    handle.write(json.dumps({"session": session}) + "\n")
                handle.flush()
                os.fsync(handle.fileno())
            os.replace(tmp_name, self.path)
        except BaseException:
            Path(tmp_name).unlink(missing_ok=True)
            raise
        fsync_path(self.path.parent)
        if self._journal is not None:
            self._journal.close()
        self._journal = self.path.open("a")
        self._appended = 0

    def _change(self, entry: dict[str, Any]) -> None:
        """Make a change and append its journal line, on disk before the change is acknowledged. Before
        the first `compact` opens the journal, changes are made in memory only, and it writes them."""
        self._apply(entry)
        if self._journal is None:
            return
        self._journal.write(json.dumps(entry) + "\n")
        self._journal.flush()
        os.fsync(self._journal.fileno())
        self._appended += 1
        live = len(self.runs) + len(self.checkpoints) + len(self.sessions)
        if self._appended > max(_MIN_LINES_BEFORE_COMPACTING, COMPACT_FACTOR * live):
            self.compact()

    def close(self) -> None:
        if self._journal is not None:
            self._journal.close()
