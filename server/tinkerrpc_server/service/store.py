"""Server state in SQLite (WAL): models, checkpoints (state and sampler), idempotency records,
per-step metrics and the write-ahead records of steps after each model's recovery point.

A model's committed policy version and everything a Train step records change in ONE transaction
with synchronous=FULL, so a process killed at any moment restarts with a consistent state.
Calls are synchronous and short; they run on the event loop thread, which also means no await can
split a transaction (a cancelled RPC never leaves half of one behind).

What grows with steps stays bounded: step records and checkpoints by retention (service/retention.py),
reference pins (one per model and Train term) by service/reference_pins.py,
idempotency records by IDEMPOTENCY_KEEP_RECORDS and IDEMPOTENCY_KEEP_SECONDS (below). Metrics rows
(~0.7 KB a step) are kept for every committed version: GetRunHistory answers for each one; they go
with their model, or with the versions a rollback or restore abandons.
"""

from __future__ import annotations

import os
import sqlite3
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from tinkerrpc_server.service import reference_pins

# The schema as numbered migrations: MIGRATIONS[i] takes a database from user_version i to i + 1, in
# one transaction with the version bump. Releases before the numbering left user_version 0 with the
# tables of migration 1 and, depending on the release, some of what migrations 2 and 3 add: those two
# skip what is already there.


def _create_first_tables(tx: sqlite3.Connection) -> None:
    tx.execute("""
        CREATE TABLE IF NOT EXISTS models (
            name TEXT PRIMARY KEY,
            base_model TEXT NOT NULL,
            lora_rank INTEGER NOT NULL,
            train_mlp INTEGER NOT NULL,
            train_attn INTEGER NOT NULL,
            train_unembed INTEGER NOT NULL,
            renderer TEXT NOT NULL,
            seed INTEGER NOT NULL,
            vocab_size INTEGER NOT NULL,
            max_context_length INTEGER NOT NULL,
            create_time REAL NOT NULL,
            tinker_run_id TEXT NOT NULL,
            policy_version INTEGER NOT NULL,
            -- The full-state checkpoint training resumes from (restart, cancelled step): its version is
            -- the recovery point; the versions after it are rebuilt by replaying their step_inputs.
            recovery_version INTEGER NOT NULL,
            recovery_path TEXT NOT NULL
        )""")
    tx.execute("""
        CREATE TABLE IF NOT EXISTS checkpoints (
            model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            kind INTEGER NOT NULL,
            name TEXT NOT NULL,
            policy_version INTEGER NOT NULL,
            tinker_path TEXT NOT NULL,
            create_time REAL NOT NULL,
            automatic INTEGER NOT NULL,
            PRIMARY KEY (model, kind, name)
        )""")
    tx.execute("""
        CREATE TABLE IF NOT EXISTS idempotency (
            model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            key TEXT NOT NULL,
            request_hash TEXT NOT NULL,
            policy_version INTEGER NOT NULL,
            response BLOB NOT NULL,
            PRIMARY KEY (model, key)
        )""")
    tx.execute("""
        CREATE TABLE IF NOT EXISTS step_metrics (
            model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            policy_version INTEGER NOT NULL,
            metrics BLOB NOT NULL,
            create_time REAL NOT NULL,
            PRIMARY KEY (model, policy_version)
        )""")


def _add_retention_columns(tx: sqlite3.Connection) -> None:
    """Retention asked for at CreateModel (NULL: the server's --keep-* flag), and each checkpoint's size
    as the backend reported it after the save (NULL until then, or if it never does)."""
    for table, column in (
        ("models", "keep_sampler_versions"),
        ("models", "keep_state_checkpoints"),
        ("checkpoints", "size_bytes"),
    ):
        present = {str(r[1]) for r in tx.execute(f"PRAGMA table_info({table})")}
        if column not in present:
            tx.execute(f"ALTER TABLE {table} ADD COLUMN {column} INTEGER")


def _create_step_inputs(tx: sqlite3.Connection) -> None:
    # What a committed step without a state checkpoint sent the backend (service/recovery.py encodes
    # it), replayed on top of the recovery point; only versions after the recovery point are kept.
    tx.execute("""
        CREATE TABLE IF NOT EXISTS step_inputs (
            model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            policy_version INTEGER NOT NULL,
            header TEXT NOT NULL,
            arrays BLOB NOT NULL,
            PRIMARY KEY (model, policy_version)
        )""")


def _add_idempotency_time(tx: sqlite3.Connection) -> None:
    # When each record was made, for its retention (Store.prune_idempotency); NULL for older records.
    tx.execute("ALTER TABLE idempotency ADD COLUMN create_time REAL")


MIGRATIONS: tuple[Callable[[sqlite3.Connection], None], ...] = (
    _create_first_tables,
    _add_retention_columns,
    _create_step_inputs,
    _add_idempotency_time,
    reference_pins.create_table,
)
SCHEMA_VERSION = len(MIGRATIONS)

# Idempotency retention: a model's record goes once it is neither among its newest KEEP_RECORDS nor
# younger than KEEP_SECONDS. The SDK retries a Train within one call (seconds to minutes) and a caller
# that passes its own keys may retry after restarting its process, so both bounds are generous; a
# retry of a key pruned since is a new step. Checked every PRUNE_EVERY records (one scan of the table).
IDEMPOTENCY_KEEP_RECORDS = 10_000
IDEMPOTENCY_KEEP_SECONDS = 7 * 24 * 3600.0
IDEMPOTENCY_PRUNE_EVERY = 100


class SchemaTooNewError(Exception):
    """The database was written by a newer tinkerrpc than this one."""


# Values of the `kind` column, equal to tinkerrpc.v1.CheckpointKind numbers.
KIND_STATE = 1
KIND_SAMPLER = 2


@dataclass(frozen=True)
class ModelRow:
    name: str
    base_model: str
    lora_rank: int
    train_mlp: bool
    train_attn: bool
    train_unembed: bool
    renderer: str
    seed: int
    vocab_size: int
    max_context_length: int
    create_time: float
    tinker_run_id: str
    policy_version: int
    recovery_version: int
    recovery_path: str
    keep_sampler_versions: int | None = None
    keep_state_checkpoints: int | None = None


@dataclass(frozen=True)
class CheckpointRow:
    model: str
    kind: int
    name: str
    policy_version: int
    tinker_path: str
    create_time: float
    automatic: bool
    size_bytes: int | None = None


@dataclass(frozen=True)
class MetricsRow:
    policy_version: int
    metrics: bytes  # a serialized tinkerrpc.v1.TrainMetrics
    create_time: float


@dataclass(frozen=True)
class StepInputsRow:
    policy_version: int
    header: str  # JSON: loss, its config, each optimizer step (datums and Adam params), each datum's layout
    arrays: bytes  # the datums' tokens and loss inputs


@dataclass(frozen=True)
class IdempotencyRow:
    request_hash: str
    policy_version: int
    response: bytes


class Store:
    def __init__(self, path: Path) -> None:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        # The owner's alone: SQLite gives its -wal and -shm files the mode of the database file.
        os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o600))
        os.chmod(path, 0o600)
        self._db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
        self._db.row_factory = sqlite3.Row
        self._db.execute("PRAGMA journal_mode=WAL")
        self._db.execute("PRAGMA synchronous=FULL")
        self._db.execute("PRAGMA foreign_keys=ON")
        try:
            self._migrate(path)
        except BaseException:
            self._db.close()
            raise

    def _migrate(self, path: Path) -> None:
        """Apply the migrations the database lacks, each in its own transaction with its version bump
        (a crash between two leaves a database at the earlier version, which the next start resumes)."""
        while True:
            with self.transaction() as tx:
                version = int(tx.execute("PRAGMA user_version").fetchone()[0])
                if version > SCHEMA_VERSION:
                    raise SchemaTooNewError(
                        f"{path} has schema version {version}, newer than the {SCHEMA_VERSION} this "
                        "tinkerrpc knows: it was written by a newer release; run that release (or a "
                        "later one) on this data directory, or start with another --data-dir"
                    )
                if version == SCHEMA_VERSION:
                    return
                MIGRATIONS[version](tx)
                # PRAGMA takes no bound parameters; the value is our own integer.
                tx.execute(f"PRAGMA user_version = {version + 1}")

    def close(self) -> None:
        self._db.close()

    @contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        self._db.execute("BEGIN IMMEDIATE")
        try:
            yield self._db
        except BaseException:
            self._db.execute("ROLLBACK")
            raise
        self._db.execute("COMMIT")

    # models

    def insert_model(self, row: ModelRow, tx: sqlite3.Connection) -> None:
        tx.execute(
            "INSERT INTO models VALUES (:name, :base_model, :lora_rank, :train_mlp, :train_attn, :train_unembed,"
            " :renderer, :seed, :vocab_size, :max_context_length, :create_time, :tinker_run_id, :policy_version,"
            " :recovery_version, :recovery_path, :keep_sampler_versions, :keep_state_checkpoints)",
            row.__dict__,
        )

    def get_model(self, name: str) -> ModelRow | None:
        row = self._db.execute("SELECT * FROM models WHERE name = ?", (name,)).fetchone()
        return _model_row(row) if row else None

    def list_models(self) -> list[ModelRow]:
        return [_model_row(r) for r in self._db.execute("SELECT * FROM models ORDER BY name")]

    def delete_model(self, name: str) -> None:
        with self.transaction() as tx:
            tx.execute("DELETE FROM models WHERE name = ?", (name,))

    def set_run_id(self, name: str, tinker_run_id: str, tx: sqlite3.Connection | None = None) -> None:
        (tx or self._db).execute("UPDATE models SET tinker_run_id = ? WHERE name = ?", (tinker_run_id, name))

    def set_version(
        self, tx: sqlite3.Connection, name: str, version: int, recovery: tuple[int, str] | None
    ) -> None:
        tx.execute("UPDATE models SET policy_version = ? WHERE name = ?", (version, name))
        if recovery is not None:
            tx.execute(
                "UPDATE models SET recovery_version = ?, recovery_path = ? WHERE name = ?", (*recovery, name)
            )
            # Replay starts after the recovery point: the records up to it are no longer needed.
            tx.execute("DELETE FROM step_inputs WHERE model = ? AND policy_version <= ?", (name, recovery[0]))

    # checkpoints

    def put_checkpoint(self, tx: sqlite3.Connection, row: CheckpointRow) -> None:
        """Insert, replacing an automatic checkpoint of the same name left by an abandoned timeline."""
        values = (row.model, row.kind, row.name, row.policy_version, row.tinker_path, row.create_time)
        tx.execute(
            "INSERT OR REPLACE INTO checkpoints VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
            (*values, int(row.automatic), row.size_bytes),
        )

    def get_checkpoint(self, model: str, kind: int, name: str) -> CheckpointRow | None:
        row = self._db.execute(
            "SELECT * FROM checkpoints WHERE model = ? AND kind = ? AND name = ?", (model, kind, name)
        ).fetchone()
        return _checkpoint_row(row) if row else None

    def list_checkpoints(self, model: str) -> list[CheckpointRow]:
        rows = self._db.execute(
            "SELECT * FROM checkpoints WHERE model = ? ORDER BY create_time, policy_version, kind", (model,)
        )
        return [_checkpoint_row(r) for r in rows]

    def sampler_path(self, model: str, version: int) -> str | None:
        row = self._db.execute(
            "SELECT tinker_path FROM checkpoints WHERE model = ? AND kind = ? AND policy_version = ?",
            (model, KIND_SAMPLER, version),
        ).fetchone()
        return str(row[0]) if row else None

    def sampleable_versions(self, model: str) -> list[int]:
        rows = self._db.execute(
            "SELECT policy_version FROM checkpoints WHERE model = ? AND kind = ? ORDER BY policy_version",
            (model, KIND_SAMPLER),
        )
        return [int(r[0]) for r in rows]

    def delete_checkpoint(self, model: str, kind: int, name: str) -> None:
        with self.transaction() as tx:
            tx.execute(
                "DELETE FROM checkpoints WHERE model = ? AND kind = ? AND name = ?", (model, kind, name)
            )

    def prune(
        self,
        tx: sqlite3.Connection,
        model: str,
        keep_sampler_versions: int,
        keep_state_checkpoints: int,
        pinned_versions: set[int],
    ) -> list[str]:
        """Forget the checkpoints the retention policy no longer keeps; returns their paths to delete.
        Kept: sampler checkpoints of the latest `keep_sampler_versions` versions, of versions a named
        state checkpoint holds and of `pinned_versions`; the latest `keep_state_checkpoints` automatic
        state checkpoints, every named one and the recovery point."""
        samplers = tx.execute(
            "SELECT name, policy_version, tinker_path FROM checkpoints WHERE model = ? AND kind = ?"
            " ORDER BY policy_version DESC",
            (model, KIND_SAMPLER),
        ).fetchall()
        held = pinned_versions | {
            int(r[0])
            for r in tx.execute(
                "SELECT policy_version FROM checkpoints WHERE model = ? AND kind = ? AND automatic = 0",
                (model, KIND_STATE),
            )
        }
        doomed = [
            (KIND_SAMPLER, str(r[0]), str(r[2]))
            for r in samplers[keep_sampler_versions:]
            if int(r[1]) not in held
        ]
        recovery_path = tx.execute("SELECT recovery_path FROM models WHERE name = ?", (model,)).fetchone()
        states = tx.execute(
            "SELECT name, tinker_path FROM checkpoints WHERE model = ? AND kind = ? AND automatic = 1"
            " ORDER BY create_time DESC, policy_version DESC",
            (model, KIND_STATE),
        ).fetchall()
        doomed += [
            (KIND_STATE, str(r[0]), str(r[1]))
            for r in states[keep_state_checkpoints:]
            if recovery_path is None or str(r[1]) != str(recovery_path[0])
        ]
        tx.executemany(
            "DELETE FROM checkpoints WHERE model = ? AND kind = ? AND name = ?",
            [(model, kind, name) for kind, name, _ in doomed],
        )
        return [path for _, _, path in doomed]

    def set_sizes(self, model: str, sizes: dict[str, int]) -> None:
        """Record the sizes the backend reported for the model's checkpoints, by tinker path. Their commit
        does not fsync (WAL with synchronous=NORMAL stays consistent): the next FULL commit, a Train's,
        syncs the log with them, and sizes a crash loses before it are unsized again and read anew.
        One fsync per step instead of two."""
        self._db.execute("PRAGMA synchronous=NORMAL")
        try:
            with self.transaction() as tx:
                tx.executemany(
                    "UPDATE checkpoints SET size_bytes = ? WHERE model = ? AND tinker_path = ?",
                    [(size, model, path) for path, size in sizes.items()],
                )
        finally:
            self._db.execute("PRAGMA synchronous=FULL")

    def unsized_paths(self, model: str) -> list[str]:
        rows = self._db.execute(
            "SELECT tinker_path FROM checkpoints WHERE model = ? AND size_bytes IS NULL", (model,)
        )
        return [str(r[0]) for r in rows]

    def checkpoint_bytes(self, model: str) -> int:
        row = self._db.execute(
            "SELECT COALESCE(SUM(size_bytes), 0) FROM checkpoints WHERE model = ?", (model,)
        ).fetchone()
        return int(row[0])

    def roll_back(self, tx: sqlite3.Connection, model: str, version: int) -> list[str]:
        """Forget what versions after `version` recorded but their idempotency records (a retried
        acknowledged key is still answered from its record), and the reference pins they name or set;
        returns their sampler paths to delete."""
        paths = [
            str(r[0])
            for r in tx.execute(
                "SELECT tinker_path FROM checkpoints WHERE model = ? AND kind = ? AND policy_version > ?",
                (model, KIND_SAMPLER, version),
            )
        ]
        tx.execute(
            "DELETE FROM checkpoints WHERE model = ? AND kind = ? AND policy_version > ?",
            (model, KIND_SAMPLER, version),
        )
        tx.execute("DELETE FROM step_inputs WHERE model = ? AND policy_version > ?", (model, version))
        tx.execute("DELETE FROM step_metrics WHERE model = ? AND policy_version > ?", (model, version))
        tx.execute("UPDATE models SET policy_version = ? WHERE name = ?", (version, model))
        reference_pins.release_rolled_back(tx, model, version)
        return paths

    # write-ahead step records

    def put_step_inputs(
        self, tx: sqlite3.Connection, model: str, version: int, header: str, arrays: bytes
    ) -> None:
        tx.execute("INSERT INTO step_inputs VALUES (?, ?, ?, ?)", (model, version, header, arrays))

    def step_inputs(self, model: str, after: int) -> list[StepInputsRow]:
        """The model's step records after version `after`, ascending."""
        rows = self._db.execute(
            "SELECT policy_version, header, arrays FROM step_inputs WHERE model = ? AND policy_version > ?"
            " ORDER BY policy_version",
            (model, after),
        )
        return [StepInputsRow(int(r[0]), str(r[1]), bytes(r[2])) for r in rows]

    def step_input_versions(self, model: str, after: int) -> list[int]:
        rows = self._db.execute(
            "SELECT policy_version FROM step_inputs WHERE model = ? AND policy_version > ?"
            " ORDER BY policy_version",
            (model, after),
        )
        return [int(r[0]) for r in rows]

    # idempotency and metrics

    def get_idempotency(self, model: str, key: str) -> IdempotencyRow | None:
        row = self._db.execute(
            "SELECT request_hash, policy_version, response FROM idempotency WHERE model = ? AND key = ?",
            (model, key),
        ).fetchone()
        return IdempotencyRow(row[0], int(row[1]), bytes(row[2])) if row else None

    def put_idempotency(
        self, tx: sqlite3.Connection, model: str, key: str, request_hash: str, version: int, response: bytes
    ) -> None:
        now = time.time()
        inserted = tx.execute(
            "INSERT INTO idempotency (model, key, request_hash, policy_version, response, create_time)"
            " VALUES (?, ?, ?, ?, ?, ?)",
            (model, key, request_hash, version, response, now),
        )
        if (inserted.lastrowid or 0) % IDEMPOTENCY_PRUNE_EVERY == 0:
            self.prune_idempotency(tx, now, IDEMPOTENCY_KEEP_RECORDS, IDEMPOTENCY_KEEP_SECONDS)

    def prune_idempotency(
        self, tx: sqlite3.Connection, now: float, keep_records: int, keep_seconds: float
    ) -> int:
        """Delete every model's records beyond its newest `keep_records` (insertion order) that are
        older than `keep_seconds` (a record without a time counts as old); the number deleted."""
        deleted = tx.execute(
            "DELETE FROM idempotency WHERE COALESCE(create_time, 0) < ? AND rowid IN ("
            " SELECT rowid FROM (SELECT rowid, ROW_NUMBER() OVER"
            " (PARTITION BY model ORDER BY rowid DESC) AS newer FROM idempotency) WHERE newer > ?)",
            (now - keep_seconds, keep_records),
        )
        return deleted.rowcount

    def put_metrics(self, tx: sqlite3.Connection, model: str, version: int, metrics: bytes) -> None:
        tx.execute(
            "INSERT OR REPLACE INTO step_metrics VALUES (?, ?, ?, ?)", (model, version, metrics, time.time())
        )

    def metrics_rows(self, model: str, first: int, last: int | None, limit: int) -> list[MetricsRow]:
        """Up to `limit` steps' metrics from version `first` to `last` (None: the newest), ascending."""
        rows = self._db.execute(
            "SELECT policy_version, metrics, create_time FROM step_metrics WHERE model = ?"
            " AND policy_version >= ? AND policy_version <= ? ORDER BY policy_version LIMIT ?",
            (model, first, last if last is not None else 2**63 - 1, limit),
        )
        return [MetricsRow(int(r[0]), bytes(r[1]), float(r[2])) for r in rows]


def _model_row(row: sqlite3.Row) -> ModelRow:
    values = dict(row)
    for flag in ("train_mlp", "train_attn", "train_unembed"):
        values[flag] = bool(values[flag])
    return ModelRow(**values)


def _checkpoint_row(row: sqlite3.Row) -> CheckpointRow:
    values = dict(row)
    values["automatic"] = bool(values["automatic"])
    return CheckpointRow(**values)
