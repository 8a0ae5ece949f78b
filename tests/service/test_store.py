"""The SQLite store in-process: numbered migrations (fresh, from every unversioned release's schema, and
a database newer than the code), transactions, idempotency records, write-ahead step records, rollback."""

from __future__ import annotations

import sqlite3
import time
from pathlib import Path

import pytest

from tinkerrpc_server.server import ServerConfig, serve
from tinkerrpc_server.service import store as store_module
from tinkerrpc_server.service.store import (
    KIND_SAMPLER,
    SCHEMA_VERSION,
    CheckpointRow,
    ModelRow,
    SchemaTooNewError,
    Store,
)

pytestmark = pytest.mark.unit

# The SQL the unversioned releases ran at every open (their user_version stayed 0), their statements
# laid out compactly: the first release (2ad2137), retention's columns in CREATE (79361c0, which also ALTERed them
# into older databases) and the write-ahead step records (2db3ed2, the last before numbered migrations).
FIRST_RELEASE = """
CREATE TABLE IF NOT EXISTS models (
    name TEXT PRIMARY KEY, base_model TEXT NOT NULL, lora_rank INTEGER NOT NULL,
    train_mlp INTEGER NOT NULL, train_attn INTEGER NOT NULL, train_unembed INTEGER NOT NULL,
    renderer TEXT NOT NULL, seed INTEGER NOT NULL, vocab_size INTEGER NOT NULL,
    max_context_length INTEGER NOT NULL, create_time REAL NOT NULL, tinker_run_id TEXT NOT NULL,
    policy_version INTEGER NOT NULL, recovery_version INTEGER NOT NULL, recovery_path TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS checkpoints (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE, kind INTEGER NOT NULL,
    name TEXT NOT NULL, policy_version INTEGER NOT NULL, tinker_path TEXT NOT NULL,
    create_time REAL NOT NULL, automatic INTEGER NOT NULL, PRIMARY KEY (model, kind, name)
);
CREATE TABLE IF NOT EXISTS idempotency (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE, key TEXT NOT NULL,
    request_hash TEXT NOT NULL, policy_version INTEGER NOT NULL, response BLOB NOT NULL,
    PRIMARY KEY (model, key)
);
CREATE TABLE IF NOT EXISTS step_metrics (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE, policy_version INTEGER NOT NULL,
    metrics BLOB NOT NULL, create_time REAL NOT NULL, PRIMARY KEY (model, policy_version)
);
"""
RETENTION_RELEASE = FIRST_RELEASE.replace(
    "recovery_path TEXT NOT NULL\n",
    "recovery_path TEXT NOT NULL,\n    keep_sampler_versions INTEGER, keep_state_checkpoints INTEGER\n",
).replace("automatic INTEGER NOT NULL,", "automatic INTEGER NOT NULL, size_bytes INTEGER,")
STEP_RECORDS_RELEASE = (
    RETENTION_RELEASE
    + """
CREATE TABLE IF NOT EXISTS step_inputs (
    model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE, policy_version INTEGER NOT NULL,
    header TEXT NOT NULL, arrays BLOB NOT NULL, PRIMARY KEY (model, policy_version)
);
"""
)
# The first release's database after the retention release's ALTER loop stopped part-way (each ALTER
# committed on its own).
HALF_ALTERED = FIRST_RELEASE + "ALTER TABLE models ADD COLUMN keep_sampler_versions INTEGER;"

MODEL_COLUMNS = [
    "name", "base_model", "lora_rank", "train_mlp", "train_attn", "train_unembed", "renderer", "seed",
    "vocab_size", "max_context_length", "create_time", "tinker_run_id", "policy_version",
    "recovery_version", "recovery_path", "keep_sampler_versions", "keep_state_checkpoints",
]  # fmt: skip
CHECKPOINT_COLUMNS = [
    "model", "kind", "name", "policy_version", "tinker_path", "create_time", "automatic", "size_bytes",
]  # fmt: skip


def _model(name: str = "m", **changes: object) -> ModelRow:
    values: dict[str, object] = dict(
        name=name, base_model="tinkerrpc/tiny-chat", lora_rank=8, train_mlp=True, train_attn=True,
        train_unembed=False, renderer="r", seed=7, vocab_size=300, max_context_length=512,
        create_time=1.0, tinker_run_id="run-1", policy_version=0, recovery_version=0,
        recovery_path="tinker://run-1/weights/step_000000",
    )  # fmt: skip
    values.update(changes)
    return ModelRow(**values)  # type: ignore[arg-type]


def _checkpoint(model: str, kind: int, name: str, version: int, when: float = 1.0) -> CheckpointRow:
    folder = "sampler_weights" if kind == KIND_SAMPLER else "weights"
    return CheckpointRow(model, kind, name, version, f"tinker://run-1/{folder}/{name}", when, True)


def _columns(path: Path, table: str) -> list[str]:
    with sqlite3.connect(path) as db:
        return [str(r[1]) for r in db.execute(f"PRAGMA table_info({table})")]


def _user_version(path: Path) -> int:
    with sqlite3.connect(path) as db:
        return int(db.execute("PRAGMA user_version").fetchone()[0])


def test_a_fresh_database_gets_every_migration(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    Store(path).close()
    assert _user_version(path) == SCHEMA_VERSION == len(store_module.MIGRATIONS)
    assert _columns(path, "models") == MODEL_COLUMNS
    assert _columns(path, "checkpoints") == CHECKPOINT_COLUMNS
    assert _columns(path, "step_inputs") == ["model", "policy_version", "header", "arrays"]
    # Opening again applies nothing and keeps the rows.
    store = Store(path)
    with store.transaction() as tx:
        store.insert_model(_model(), tx)
    store.close()
    assert [r.name for r in Store(path).list_models()] == ["m"]
    assert _user_version(path) == SCHEMA_VERSION


@pytest.mark.parametrize(
    "old_schema",
    [FIRST_RELEASE, HALF_ALTERED, RETENTION_RELEASE, STEP_RECORDS_RELEASE],
    ids=["first-release", "half-altered", "retention-release", "step-records-release"],
)
def test_a_database_of_an_unversioned_release_upgrades(tmp_path: Path, old_schema: str) -> None:
    path = tmp_path / "db.sqlite3"
    with sqlite3.connect(path) as db:
        db.executescript(old_schema)
        db.execute(
            "INSERT INTO models (name, base_model, lora_rank, train_mlp, train_attn, train_unembed, renderer,"
            " seed, vocab_size, max_context_length, create_time, tinker_run_id, policy_version,"
            " recovery_version, recovery_path) VALUES"
            " ('old', 'tinkerrpc/tiny-chat', 4, 1, 1, 1, 'r', 0, 300, 512, 1.0, 'run-0', 2, 2, 'tinker://s')"
        )
        db.execute(
            "INSERT INTO checkpoints (model, kind, name, policy_version, tinker_path, create_time, automatic)"
            " VALUES ('old', 2, 'v000002', 2, 'tinker://run-0/sampler_weights/v000002', 1.0, 1)"
        )
    assert _user_version(path) == 0

    store = Store(path)
    assert _user_version(path) == SCHEMA_VERSION
    assert _columns(path, "models") == MODEL_COLUMNS
    assert _columns(path, "checkpoints") == CHECKPOINT_COLUMNS
    old = store.get_model("old")
    assert old is not None
    assert (old.policy_version, old.keep_sampler_versions, old.keep_state_checkpoints) == (2, None, None)
    assert [c.size_bytes for c in store.list_checkpoints("old")] == [None]
    # Everything the current code writes fits the upgraded database.
    with store.transaction() as tx:
        store.insert_model(_model("new", keep_sampler_versions=3, keep_state_checkpoints=2), tx)
        store.put_step_inputs(tx, "old", 3, "{}", b"x")
    store.set_sizes("old", {"tinker://run-0/sampler_weights/v000002": 42})
    assert store.checkpoint_bytes("old") == 42
    # Sizes commit without an fsync of their own; every other commit still syncs (synchronous=FULL, 2).
    with store.transaction() as tx:
        assert tx.execute("PRAGMA synchronous").fetchone()[0] == 2
    assert [r.policy_version for r in store.step_inputs("old", after=2)] == [3]
    new = store.get_model("new")
    assert new is not None and (new.keep_sampler_versions, new.keep_state_checkpoints) == (3, 2)


def test_a_database_newer_than_the_code_refuses_to_open(tmp_path: Path) -> None:
    path = tmp_path / "db.sqlite3"
    Store(path).close()
    with sqlite3.connect(path) as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    with pytest.raises(SchemaTooNewError, match=f"schema version {SCHEMA_VERSION + 1}, newer than"):
        Store(path)
    assert _user_version(path) == SCHEMA_VERSION + 1


def test_a_failed_migration_leaves_the_previous_version(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def half_done(tx: sqlite3.Connection) -> None:
        tx.execute("CREATE TABLE half_done (x INTEGER)")
        raise RuntimeError("migration failed")

    monkeypatch.setattr(store_module, "MIGRATIONS", (*store_module.MIGRATIONS, half_done))
    monkeypatch.setattr(store_module, "SCHEMA_VERSION", SCHEMA_VERSION + 1)
    path = tmp_path / "db.sqlite3"
    with pytest.raises(RuntimeError, match="migration failed"):
        Store(path)
    # The earlier migrations committed each with its version; the failed one left nothing behind.
    assert _user_version(path) == SCHEMA_VERSION
    with sqlite3.connect(path) as db:
        tables = {str(r[0]) for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    assert "half_done" not in tables and "step_inputs" in tables


def test_a_transaction_is_all_or_nothing(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        store.insert_model(_model(), tx)
    with pytest.raises(RuntimeError), store.transaction() as tx:
        store.set_version(tx, "m", 1, None)
        store.put_checkpoint(tx, _checkpoint("m", KIND_SAMPLER, "v000001", 1))
        store.put_metrics(tx, "m", 1, b"metrics")
        raise RuntimeError("the step failed before its commit")
    row = store.get_model("m")
    assert row is not None and row.policy_version == 0
    assert store.list_checkpoints("m") == []
    assert store.metrics_rows("m", 0, None, 10) == []


def test_idempotency_records_are_kept_per_model_and_key(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        store.insert_model(_model("a"), tx)
        store.insert_model(_model("b"), tx)
        store.put_idempotency(tx, "a", "key", "hash-a", 1, b"response-a")
        store.put_idempotency(tx, "b", "key", "hash-b", 4, b"response-b")
    record = store.get_idempotency("a", "key")
    assert record is not None
    assert (record.request_hash, record.policy_version, record.response) == ("hash-a", 1, b"response-a")
    assert store.get_idempotency("a", "other") is None
    with pytest.raises(sqlite3.IntegrityError), store.transaction() as tx:
        store.put_idempotency(tx, "a", "key", "hash-c", 2, b"response-c")
    # A rollback forgets the later versions but keeps their idempotency records; deleting the model
    # takes them.
    with store.transaction() as tx:
        store.set_version(tx, "a", 3, None)
    with store.transaction() as tx:
        store.roll_back(tx, "a", 0)
    assert store.get_idempotency("a", "key") is not None
    store.delete_model("a")
    assert store.get_idempotency("a", "key") is None
    assert store.get_idempotency("b", "key") is not None


def test_idempotency_records_are_pruned_when_both_old_and_beyond_the_newest(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        store.insert_model(_model("a"), tx)
        store.insert_model(_model("b"), tx)
        for step in range(1, 31):
            store.put_idempotency(tx, "a", f"key-{step}", "hash", step, b"response")
        store.put_idempotency(tx, "b", "key-1", "hash", 1, b"response")
    week = store_module.IDEMPOTENCY_KEEP_SECONDS
    with store.transaction() as tx:
        # Young records stay however many there are.
        assert store.prune_idempotency(tx, time.time(), 10, week) == 0
    with store.transaction() as tx:
        assert store.prune_idempotency(tx, time.time() + week + 1, 10, week) == 20
    kept = [step for step in range(1, 31) if store.get_idempotency("a", f"key-{step}") is not None]
    assert kept == list(range(21, 31))
    assert store.get_idempotency("b", "key-1") is not None  # each model keeps its own newest


def test_idempotency_records_are_pruned_as_they_are_made(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(store_module, "IDEMPOTENCY_KEEP_RECORDS", 5)
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        store.insert_model(_model("a"), tx)
    records = store_module.IDEMPOTENCY_PRUNE_EVERY
    with store.transaction() as tx:
        for step in range(records - 1):
            store.put_idempotency(tx, "a", f"key-{step}", "hash", step, b"response")
        # Records of a release before their retention have no time: they count as old.
        tx.execute("UPDATE idempotency SET create_time = NULL WHERE policy_version < 10")
    with store.transaction() as tx:
        store.put_idempotency(tx, "a", "newest", "hash", records, b"response")
    kept = [step for step in range(records - 1) if store.get_idempotency("a", f"key-{step}") is not None]
    # The timeless ones beyond the newest 5 went with that insert; the young ones stay.
    assert kept == list(range(10, records - 1))
    assert store.get_idempotency("a", "newest") is not None


def test_step_records_after_the_recovery_point_and_rollback(tmp_path: Path) -> None:
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        store.insert_model(_model(), tx)
    for version in range(1, 6):
        with store.transaction() as tx:
            store.set_version(tx, "m", version, (version, f"tinker://s{version}") if version == 3 else None)
            store.put_checkpoint(tx, _checkpoint("m", KIND_SAMPLER, f"v{version:06d}", version))
            store.put_metrics(tx, "m", version, b"metrics")
            if version != 3:
                store.put_step_inputs(tx, "m", version, "{}", bytes([version]))
    # The state checkpoint at 3 moved the recovery point: the records up to it went with that commit.
    assert store.step_input_versions("m", after=0) == [4, 5]
    row = store.get_model("m")
    assert row is not None and (row.recovery_version, row.recovery_path) == (3, "tinker://s3")
    with store.transaction() as tx:
        stale = store.roll_back(tx, "m", 4)
    assert stale == ["tinker://run-1/sampler_weights/v000005"]
    assert store.step_input_versions("m", after=0) == [4]
    assert [m.policy_version for m in store.metrics_rows("m", 0, None, 10)] == [1, 2, 3, 4]
    assert store.sampleable_versions("m") == [1, 2, 3, 4]
    row = store.get_model("m")
    assert row is not None and row.policy_version == 4


async def test_serve_does_not_start_on_a_newer_database(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    data_dir = tmp_path / "data"
    Store(data_dir / "tinkerrpc.sqlite3").close()
    with sqlite3.connect(data_dir / "tinkerrpc.sqlite3") as db:
        db.execute(f"PRAGMA user_version = {SCHEMA_VERSION + 1}")
    assert await serve(ServerConfig(data_dir=data_dir), engine=None) == 1
    assert f"cannot start: {data_dir / 'tinkerrpc.sqlite3'} has schema version" in caplog.text
