"""The engine's checkpoint operations: saving a live training client's state as a named checkpoint or an
unnamed sampler snapshot, the training runs and their checkpoints as the SDK lists them, deleting one and
setting its expiry, and the sampler of a checkpoint's weights.

`CheckpointOperations` is a base of core.Engine, so routes call these as the engine's own methods; it
works on the engine's index (storage.py), sampler ledger (snapshots.py) and runtime registry
(runtimes.py), which the engine makes.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import time
from dataclasses import replace
from pathlib import Path

from tinker import types

from tinkerrpc.contract.limits import MAX_CHECKPOINT_TTL_SECONDS
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.runtime import EngineUserError
from tinkerrpc_server.engine.runtimes import RuntimeRegistry
from tinkerrpc_server.engine.sessions import sampling_session_prefix, session_of
from tinkerrpc_server.engine.snapshots import Sampler, SamplerLedger, UnnamedSnapshot
from tinkerrpc_server.engine.storage import (
    CheckpointKind,
    CheckpointRecord,
    RunRecord,
    Storage,
    UnknownPathError,
    directory_size,
    now_iso,
)

log = logging.getLogger("tinkerrpc.engine")


def expiry(ttl_seconds: int | None) -> float | None:
    """When a checkpoint given `ttl_seconds` expires (POSIX seconds), None for never."""
    if ttl_seconds is None:
        return None
    if not 1 <= ttl_seconds <= MAX_CHECKPOINT_TTL_SECONDS:
        raise protocol.BadRequest(f"ttl_seconds must be 1 to {MAX_CHECKPOINT_TTL_SECONDS}, got {ttl_seconds}")
    return time.time() + ttl_seconds


class CheckpointOperations:
    """core.Engine's checkpoint methods (the engine sets these rooms in its constructor)."""

    _storage: Storage
    _ledger: SamplerLedger
    _runtimes: RuntimeRegistry

    def save_checkpoint(
        self,
        model_id: str,
        kind: CheckpointKind,
        name: str,
        overwrite: bool,
        metadata: dict[str, str],
        ttl_seconds: int | None,
        ephemeral: bool = False,
    ) -> CheckpointRecord:
        """Save a live model's adapter (and for "training", its optimizer) as a checkpoint, deleted
        `ttl_seconds` from now if set; an ephemeral one does not outlive this engine (compute thread)."""
        runtime = self._runtimes.live_runtime(model_id)
        directory = self._storage.checkpoint_dir(model_id, kind, name)
        expires_at = expiry(ttl_seconds)
        record = CheckpointRecord(model_id, kind, name, now_iso(), 0, metadata, expires_at, ephemeral)
        if self._storage.has_checkpoint(record.tinker_path) or directory.exists():
            if not overwrite:
                raise EngineUserError(f"checkpoint {record.tinker_path} already exists")
            self._storage.delete_checkpoint(model_id, record.checkpoint_id)
        directory.parent.mkdir(parents=True, exist_ok=True)
        runtime.save_state(model_id, directory, include_optimizer=kind == "training")
        record.size_bytes = directory_size(directory)
        self._storage.add_checkpoint(record)
        return record

    def save_unnamed_snapshot(
        self, model_id: str, name: str, metadata: dict[str, str], ttl_seconds: int | None
    ) -> CheckpointRecord:
        """An ephemeral sampler snapshot: it supersedes the model's previous unnamed one, which stays
        while it is used (compute thread)."""
        record = self.save_checkpoint(model_id, "sampler", name, False, metadata, ttl_seconds, ephemeral=True)
        doomed = self._ledger.add_snapshot(model_id, record.checkpoint_id, record.tinker_path)
        self._delete_snapshots(doomed, "past the cap of unnamed snapshots per training client")
        return record

    def save_for_sampler(
        self,
        model_id: str,
        name: str | None,
        seq_id: int | None,
        sampling_session_seq_id: int | None,
        metadata: dict[str, str],
        ttl_seconds: int | None,
        kind: types.SamplingClientKind = "snapshot",
    ) -> tuple[CheckpointRecord, str | None]:
        """save_weights_for_sampler (compute thread): with a name, a sampler checkpoint; without, an
        unnamed snapshot and a new sampling session over it (its id second)."""
        if name:
            return self.save_checkpoint(model_id, "sampler", name, False, metadata, ttl_seconds), None
        unnamed = f"sampler-{seq_id}-{secrets.token_hex(3)}"
        record = self.save_unnamed_snapshot(model_id, unnamed, metadata, ttl_seconds)
        session = sampling_session_prefix(session_of(model_id))
        sampler_id = f"{session}{sampling_session_seq_id}:{secrets.token_hex(3)}"
        sampler = replace(self._sampler_of_weights(record.tinker_path, None), sampler_id=sampler_id)
        self._ledger.add_sampler(
            self._ledger.publish_inflight(model_id, sampler) if kind == "inflight" else sampler
        )
        return record, sampler_id

    def run(self, model_id: str) -> RunRecord:
        """A training run this engine holds (UnknownPathError: none)."""
        return self._storage.get_run(model_id)

    def runs(self) -> list[RunRecord]:
        return self._storage.list_runs()

    def checkpoints(self, model_id: str) -> list[CheckpointRecord]:
        """The unexpired checkpoints of a run, oldest first."""
        return self._storage.list_checkpoints(model_id)

    def run_of_checkpoint(self, tinker_path: str) -> RunRecord:
        """The training run that saved the checkpoint at `tinker_path`."""
        record, _ = self._storage.resolve(tinker_path)
        return self._storage.get_run(record.model_id)

    def external_weights(self, model_id: str, checkpoint_id: str) -> tuple[CheckpointRecord, Path]:
        """An external_weights checkpoint and its directory (UnknownPathError: none at that id)."""
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        record, directory = self._storage.resolve(tinker_path)
        if record.kind != "external":
            raise UnknownPathError(f"{tinker_path} is not an external_weights checkpoint")
        return record, directory

    def delete_checkpoint(self, model_id: str, checkpoint_id: str) -> CheckpointRecord:
        record = self._storage.delete_checkpoint(model_id, checkpoint_id)
        log.info("deleted checkpoint %s", record.tinker_path)
        return record

    def set_checkpoint_ttl(self, model_id: str, checkpoint_id: str, ttl_seconds: int | None) -> None:
        """Expire a checkpoint `ttl_seconds` from now, or never (None)."""
        self._storage.set_expiry(f"tinker://{model_id}/{checkpoint_id}", expiry(ttl_seconds))

    def _delete_snapshots(self, doomed: list[UnnamedSnapshot], why: str) -> None:
        for snapshot in doomed:
            with contextlib.suppress(UnknownPathError):  # its owner may have deleted it already
                self._storage.delete_checkpoint(snapshot.model_id, snapshot.checkpoint_id)
            log.info("unnamed sampler snapshot %s deleted: %s", snapshot.tinker_path, why)

    def _sampler_of_weights(self, model_path: str | None, base_model: str | None) -> Sampler:
        """A sampler (of no sampling session) of a checkpoint's weights, else of `base_model`."""
        if model_path:
            record, weights_dir = self._storage.resolve(model_path)
            return Sampler("", self._storage.get_run(record.model_id).base_model, model_path, weights_dir)
        if base_model is None:
            raise protocol.BadRequest("base_model is required")
        return Sampler("", base_model, None, None)
