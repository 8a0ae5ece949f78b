"""Reference pins: a policy version that a Train names as its KL penalty's reference or its distillation
teacher stays sampleable for as long as a model trains against it, past --keep-sampler-versions.

Why: a long run's reference is often a fixed early version (ART's PipelineTrainer with a reference step
and no kl_penalty_step_lag; a teacher named by model and version), and retention keeps only the latest N
versions' sampler weights: without a pin, every KL step after N more steps would be refused.

The policy, one row per (model, term) in the service's SQLite store (a restart keeps it):
- a Train of model M whose term (kl_penalty or distillation) names version v of model R (R may be M)
  pins R@v for M's term once the request has passed its checks (a refused request changes no pin),
  replacing what that term pinned before: a fixed reference stays pinned however long the run is; a
  lagging one (the current version minus k) moves along, releasing the one before;
- a Train whose term names a base model, a checkpoint or version 0 (the base model exactly: LoRA's B
  starts at zero, so it needs no checkpoint) releases that term's pin; a Train without the term keeps
  it, so supervised steps or evaluation pauses between RL steps never cost the run its reference;
- pins go with M or R (DeleteModel), and with a rollback of M or R (RestoreCheckpoint, or recovery of a
  database whose step records are missing): the pins naming R's discarded versions, and the pins set
  by M's abandoned steps;
- no pin lapses by step count or time: a run's reference must survive however long the run leaves the
  term out, and one pin per term already bounds what a model holds. A model's versions pinned at once
  are at most MAX_PINNED_REFERENCE_VERSIONS (one more is FAILED_PRECONDITION TOO_MANY_REFERENCE_PINS
  naming the field), so its disk stays bounded.
A version whose sampler weights were gone before any Train pinned it is FAILED_PRECONDITION
REFERENCE_NOT_KEPT naming the field. Retention (service/retention.py) keeps every pinned version.
"""

from __future__ import annotations

import sqlite3

from tinkerrpc.contract.limits import MAX_PINNED_REFERENCE_VERSIONS
from tinkerrpc_server.service import errors

# The Train terms that name a policy, as the fields of TrainRequest that carry them.
TERMS = ("kl_penalty", "distillation")


def create_table(tx: sqlite3.Connection) -> None:
    """The store's migration that adds the pins (store.MIGRATIONS)."""
    tx.execute("""
        CREATE TABLE IF NOT EXISTS reference_pins (
            model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            term TEXT NOT NULL,
            reference_model TEXT NOT NULL REFERENCES models(name) ON DELETE CASCADE,
            policy_version INTEGER NOT NULL,
            -- The pinning model's version when a Train first named this reference for the term.
            pinned_at INTEGER NOT NULL,
            PRIMARY KEY (model, term)
        )""")
    tx.execute("CREATE INDEX IF NOT EXISTS reference_pins_by_reference ON reference_pins (reference_model)")


def pinned_versions(tx: sqlite3.Connection, reference_model: str) -> set[int]:
    """The versions of `reference_model` that some model's Train pins (retention keeps them)."""
    rows = tx.execute(
        "SELECT DISTINCT policy_version FROM reference_pins WHERE reference_model = ?", (reference_model,)
    )
    return {int(r[0]) for r in rows}


def pins_of(tx: sqlite3.Connection, model: str) -> dict[str, tuple[str, int]]:
    """What `model`'s terms pin: term -> (reference model, version)."""
    rows = tx.execute(
        "SELECT term, reference_model, policy_version FROM reference_pins WHERE model = ?", (model,)
    )
    return {str(r[0]): (str(r[1]), int(r[2])) for r in rows}


def hold(
    tx: sqlite3.Connection,
    model: str,
    term: str,
    reference: tuple[str, int] | None,
    at_version: int,
    field: str,
    limit: int = MAX_PINNED_REFERENCE_VERSIONS,
) -> None:
    """In a transaction: `model`'s `term` now pins `reference` (model, version), or nothing (None),
    replacing what it pinned before. Raises TOO_MANY_REFERENCE_PINS, naming `field`, when the reference
    model would have more than `limit` versions pinned (the transaction then changes nothing)."""
    assert term in TERMS, term
    if reference is None:
        tx.execute("DELETE FROM reference_pins WHERE model = ? AND term = ?", (model, term))
        return
    if pins_of(tx, model).get(term) == reference:
        return  # kept, with the version at which it was first named
    reference_model, version = reference
    others = {
        int(r[0])
        for r in tx.execute(
            "SELECT policy_version FROM reference_pins WHERE reference_model = ?"
            " AND NOT (model = ? AND term = ?)",
            (reference_model, model, term),
        )
    }
    if version not in others and len(others) >= limit:
        raise errors.failed_precondition(
            errors.TOO_MANY_REFERENCE_PINS,
            f"{field}: model {errors.shown(reference_model)} already has {len(others)} versions pinned as "
            f"references of Trains ({_versions(others)}), the most kept (MAX_PINNED_REFERENCE_VERSIONS); "
            "name one of them or a checkpoint, or delete a model that trains against one",
            {
                "field": field,
                "model": reference_model,
                "pinned_versions": _versions(others),
                "limit": limit,
            },
        )
    tx.execute(
        "INSERT OR REPLACE INTO reference_pins VALUES (?, ?, ?, ?, ?)",
        (model, term, reference_model, version, at_version),
    )


def release_rolled_back(tx: sqlite3.Connection, model: str, version: int) -> None:
    """In the transaction that moves `model` back to `version`: the pins naming its discarded versions,
    and those that its abandoned steps (from `version` on) set, go."""
    tx.execute(
        "DELETE FROM reference_pins WHERE reference_model = ? AND policy_version > ?", (model, version)
    )
    tx.execute("DELETE FROM reference_pins WHERE model = ? AND pinned_at >= ?", (model, version))


def not_kept(field: str, model: str, version: int, sampleable: list[int]) -> errors.ServiceError:
    """A committed version whose sampler weights are no longer kept, named as a Train's reference."""
    return errors.failed_precondition(
        errors.REFERENCE_NOT_KEPT,
        f"{field}: version {version} of model {errors.shown(model)} is no longer kept (retention keeps the "
        f"latest versions, those named checkpoints hold and those a Train already names; sampleable: "
        f"{_versions(set(sampleable))}); name a sampleable version, a checkpoint or the base model",
        {
            "field": field,
            "model": model,
            "policy_version": version,
            "sampleable_versions": _versions(set(sampleable)),
        },
    )


def _versions(versions: set[int]) -> str:
    """Versions as runs: [0, 3..5, 9]."""
    runs: list[list[int]] = []
    for v in sorted(versions):
        if runs and v == runs[-1][-1] + 1:
            runs[-1].append(v)
        else:
            runs.append([v])
    return "[" + ", ".join(str(r[0]) if len(r) == 1 else f"{r[0]}..{r[-1]}" for r in runs) + "]"
