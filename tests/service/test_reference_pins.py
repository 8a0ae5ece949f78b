"""Reference pins' bookkeeping on a real SQLite store (service/reference_pins.py): a term's pin replaced,
kept or released; retention keeping pinned versions; the bound per referenced model; rollback and model
deletion releasing them; a reopened store keeping them."""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from tinkerrpc.contract.limits import MAX_PINNED_REFERENCE_VERSIONS
from tinkerrpc_server.service import errors, reference_pins
from tinkerrpc_server.service.store import KIND_SAMPLER, CheckpointRow, ModelRow, Store

pytestmark = pytest.mark.unit


def _model(name: str, version: int) -> ModelRow:
    return ModelRow(
        name=name, base_model="tinkerrpc/tiny-chat", lora_rank=8, train_mlp=True, train_attn=True,
        train_unembed=True, renderer="r", seed=7, vocab_size=300, max_context_length=512, create_time=1.0,
        tinker_run_id="run", policy_version=version, recovery_version=0, recovery_path="tinker://run/s",
    )  # fmt: skip


def _store(tmp_path: Path, versions: dict[str, int]) -> Store:
    """Models at the given versions, each with a sampler checkpoint per version."""
    store = Store(tmp_path / "db.sqlite3")
    with store.transaction() as tx:
        for name, version in versions.items():
            store.insert_model(_model(name, version), tx)
            for v in range(version + 1):
                path = f"tinker://{name}/sampler_weights/v{v:06d}"
                store.put_checkpoint(tx, CheckpointRow(name, KIND_SAMPLER, f"v{v:06d}", v, path, v, True))
    return store


def _hold(store: Store, model: str, term: str, reference: tuple[str, int] | None, at: int) -> None:
    with store.transaction() as tx:
        reference_pins.hold(tx, model, term, reference, at, f"{term}.reference.version.policy_version")


def _pins(store: Store, model: str) -> dict[str, tuple[str, int]]:
    with store.transaction() as tx:
        return reference_pins.pins_of(tx, model)


def _pinned(store: Store, model: str) -> set[int]:
    with store.transaction() as tx:
        return reference_pins.pinned_versions(tx, model)


def _prune(store: Store, model: str, keep: int) -> list[int]:
    """Retention's pruning with the pinned versions held; the sampleable versions left."""
    with store.transaction() as tx:
        store.prune(tx, model, keep, 1, reference_pins.pinned_versions(tx, model))
    return store.sampleable_versions(model)


def test_a_term_pins_one_version_replaced_by_the_next_and_released_by_a_reference_without_one(
    tmp_path: Path,
) -> None:
    store = _store(tmp_path, {"m": 20, "teacher": 9})
    _hold(store, "m", "kl_penalty", ("m", 3), at=10)
    _hold(store, "m", "distillation", ("teacher", 5), at=10)
    assert _pins(store, "m") == {"kl_penalty": ("m", 3), "distillation": ("teacher", 5)}
    # A lagging reference moves along: the term's earlier version is released.
    _hold(store, "m", "kl_penalty", ("m", 4), at=11)
    assert _pinned(store, "m") == {4}
    # A base model, a checkpoint or version 0 as the term's reference releases its pin; the other stays.
    _hold(store, "m", "kl_penalty", None, at=12)
    assert _pins(store, "m") == {"distillation": ("teacher", 5)}
    assert (_pinned(store, "m"), _pinned(store, "teacher")) == (set(), {5})


def test_retention_keeps_pinned_versions_beside_the_latest(tmp_path: Path) -> None:
    store = _store(tmp_path, {"m": 20, "other": 0})
    _hold(store, "m", "kl_penalty", ("m", 2), at=5)
    _hold(store, "other", "distillation", ("m", 7), at=0)
    assert _prune(store, "m", keep=3) == [2, 7, 18, 19, 20]
    _hold(store, "other", "distillation", None, at=0)
    assert _prune(store, "m", keep=3) == [2, 18, 19, 20]


def test_a_model_has_at_most_the_contracts_versions_pinned_and_one_more_is_refused_naming_the_field(
    tmp_path: Path,
) -> None:
    limit = MAX_PINNED_REFERENCE_VERSIONS
    students = [f"s{i}" for i in range(limit + 1)]
    store = _store(tmp_path, {"teacher": limit + 5, **dict.fromkeys(students, 0)})
    for version, student in enumerate(students[:limit], start=1):
        _hold(store, student, "distillation", ("teacher", version), at=0)
    assert _pinned(store, "teacher") == set(range(1, limit + 1))
    # A version pinned already adds none; a student moving its own pin frees the version it held.
    _hold(store, students[-1], "distillation", ("teacher", 1), at=0)
    _hold(store, students[1], "distillation", ("teacher", limit + 1), at=0)
    assert _pinned(store, "teacher") == set(range(1, limit + 2)) - {2}

    with pytest.raises(errors.ServiceError) as refused:
        _hold(store, students[-1], "distillation", ("teacher", limit + 2), at=0)

    assert refused.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert "distillation.reference.version.policy_version" in refused.value.message
    (info,) = refused.value.details
    assert info.reason == "TOO_MANY_REFERENCE_PINS"  # type: ignore[attr-defined]
    assert dict(info.metadata) == {  # type: ignore[attr-defined]
        "field": "distillation.reference.version.policy_version",
        "model": "teacher",
        "pinned_versions": f"[1, 3..{limit + 1}]",
        "limit": str(limit),
    }
    assert _pins(store, students[-1]) == {"distillation": ("teacher", 1)}
    assert _pinned(store, "teacher") == set(range(1, limit + 2)) - {2}


def test_a_rollback_releases_the_pins_of_discarded_versions_and_of_abandoned_steps(tmp_path: Path) -> None:
    store = _store(tmp_path, {"m": 30, "other": 4})
    _hold(store, "m", "kl_penalty", ("m", 5), at=8)  # kept: set before version 20, names 5 <= 20
    _hold(store, "m", "distillation", ("other", 2), at=25)  # set by a step the restore abandons
    _hold(store, "other", "kl_penalty", ("m", 24), at=3)  # names a version the restore discards
    # Naming a reference again keeps the version it was first named at.
    _hold(store, "m", "kl_penalty", ("m", 5), at=29)
    with store.transaction() as tx:
        store.roll_back(tx, "m", 20)
    assert _pins(store, "m") == {"kl_penalty": ("m", 5)}
    assert _pins(store, "other") == {}


def test_deleting_either_model_releases_its_pins_and_a_reopened_store_keeps_them(tmp_path: Path) -> None:
    store = _store(tmp_path, {"m": 6, "teacher": 6, "student": 0})
    _hold(store, "m", "kl_penalty", ("m", 1), at=2)
    _hold(store, "student", "distillation", ("teacher", 3), at=0)
    _hold(store, "teacher", "kl_penalty", ("m", 2), at=4)
    store.close()

    store = Store(tmp_path / "db.sqlite3")
    assert (_pinned(store, "m"), _pinned(store, "teacher")) == ({1, 2}, {3})
    store.delete_model("teacher")
    assert (_pinned(store, "m"), _pins(store, "student")) == ({1}, {})
    store.delete_model("m")
    assert _pinned(store, "m") == set()


def test_a_version_no_longer_kept_is_refused_naming_the_field_and_what_is_sampleable() -> None:
    error = reference_pins.not_kept("kl_penalty.reference.version.policy_version", "m", 2, [0, 5, 6, 7, 9])
    assert error.code == grpc.StatusCode.FAILED_PRECONDITION
    assert error.message.startswith("kl_penalty.reference.version.policy_version: version 2 of model 'm'")
    (info,) = error.details
    assert info.reason == "REFERENCE_NOT_KEPT"  # type: ignore[attr-defined]
    assert info.metadata["sampleable_versions"] == "[0, 5..7, 9]"  # type: ignore[attr-defined]
