"""Named state checkpoints: save, list, restore (the model moves to the checkpoint's version, later
versions are dropped but their idempotency records stay: a retried acknowledged key is still answered
from its record) and delete, never the one the model would recover from nor the current sampler."""

from __future__ import annotations

import logging
import time

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.models import (
    CHECKPOINT_RESOURCE,
    ModelRegistry,
    checkpoint_info,
    sampler_name,
    state_name,
)
from tinkerrpc_server.service.retention import unload_training_client
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, CheckpointRow, Store
from tinkerrpc_server.service.validation import check_checkpoint_kind, check_checkpoint_name

log = logging.getLogger("tinkerrpc.service")


class Checkpoints:
    def __init__(self, store: Store, backend: Backend, models: ModelRegistry) -> None:
        self._store = store
        self._backend = backend
        self._models = models

    async def save(self, request: pb.SaveCheckpointRequest) -> types_pb2.CheckpointInfo:
        runtime = self._models.runtime(request.model)
        check_checkpoint_name(request.name)
        async with runtime.lock:
            row = self._models.row(request.model)
            name = request.name or state_name(row.policy_version)
            existing = self._store.get_checkpoint(row.name, KIND_STATE, name)
            if existing is not None:
                # The default name at the current version already holds exactly this state.
                if not request.name and existing.policy_version == row.policy_version:
                    return checkpoint_info(existing)
                raise errors.already_exists(
                    CHECKPOINT_RESOURCE,
                    f"{row.name}/{name}",
                    f"model {row.name!r} already has checkpoint {name!r}",
                )
            client = await self._models.training_client(row.name, runtime)
            path = (await client.save_state(name)).path
            checkpoint = CheckpointRow(
                row.name, KIND_STATE, name, row.policy_version, path, time.time(), False
            )
            with self._store.transaction() as tx:
                self._store.put_checkpoint(tx, checkpoint)
                self._store.set_version(tx, row.name, row.policy_version, (row.policy_version, path))
            self._models.events.checkpoint_saved(checkpoint_info(checkpoint), row.policy_version)
            return checkpoint_info(checkpoint)

    def infos(self, model: str) -> list[types_pb2.CheckpointInfo]:
        self._models.row(model)
        return [checkpoint_info(row) for row in self._store.list_checkpoints(model)]

    async def restore(self, request: pb.RestoreCheckpointRequest) -> types_pb2.ModelInfo:
        runtime = self._models.runtime(request.model)
        async with runtime.lock:
            self._models.row(request.model)
            checkpoint = self._store.get_checkpoint(request.model, KIND_STATE, request.checkpoint)
            if checkpoint is None:
                raise errors.not_found(
                    CHECKPOINT_RESOURCE,
                    f"{request.model}/{request.checkpoint}",
                    f"model {request.model!r} has no state checkpoint {request.checkpoint!r}",
                )
            version = checkpoint.policy_version
            # A refused restore changes nothing: the live training client keeps training.
            client = await self._backend.service.create_training_client_from_state_with_optimizer(
                checkpoint.tinker_path
            )
            runtime.dirty = True
            # Fresh sampler weights from the restored state: an older sampler row of this version may
            # belong to another timeline.
            sampler_path = (await client.save_weights_for_sampler(sampler_name(version))).path
            old_sampler = self._store.sampler_path(request.model, version)
            with self._store.transaction() as tx:
                stale_paths = self._store.roll_back(tx, request.model, version)
                self._store.put_checkpoint(
                    tx,
                    CheckpointRow(
                        request.model,
                        KIND_SAMPLER,
                        sampler_name(version),
                        version,
                        sampler_path,
                        time.time(),
                        True,
                    ),
                )
                self._store.set_version(tx, request.model, version, (version, checkpoint.tinker_path))
                self._store.set_run_id(request.model, str(client.model_id), tx)
            # The versions from `version` on are discarded: a key of one names weights that are gone.
            self._models.sample_cache.discard(request.model, version)
            self._models.events.restored(checkpoint_info(checkpoint))
            dropped, runtime.training_client = runtime.training_client, client
            runtime.dirty = False
        if dropped is not None:
            unload_training_client(dropped)
        await self._models.delete_tinker_paths([*stale_paths, *([old_sampler] if old_sampler else [])])
        log.info("model %s restored to %s (version %d)", request.model, request.checkpoint, version)
        return self._models.info(self._models.row(request.model))

    async def delete(self, request: pb.DeleteCheckpointRequest) -> None:
        runtime = self._models.runtime(request.model)
        kind = request.kind or types_pb2.CHECKPOINT_KIND_STATE  # == KIND_STATE, typed as the proto enum
        check_checkpoint_kind(kind)
        async with runtime.lock:
            row = self._models.row(request.model)
            checkpoint = self._store.get_checkpoint(request.model, kind, request.checkpoint)
            if checkpoint is None:
                raise errors.not_found(
                    CHECKPOINT_RESOURCE,
                    f"{request.model}/{request.checkpoint}",
                    f"model {request.model!r} has no {kind_word(kind)} checkpoint {request.checkpoint!r}",
                )
            if kind == KIND_SAMPLER and checkpoint.policy_version == row.policy_version:
                raise errors.failed_precondition(
                    errors.CURRENT_SAMPLER_CHECKPOINT,
                    f"{request.checkpoint!r} serves the current version {row.policy_version} and cannot be deleted",
                    {"policy_version": row.policy_version},
                )
            if kind == KIND_STATE and checkpoint.tinker_path == row.recovery_path:
                raise errors.failed_precondition(
                    errors.RECOVERY_CHECKPOINT,
                    f"{request.checkpoint!r} is the state the model recovers from after a restart; "
                    "save a newer checkpoint first",
                    {"policy_version": checkpoint.policy_version},
                )
            # Row first: a crash in between leaves an unreferenced file, never a dangling row.
            self._store.delete_checkpoint(request.model, kind, request.checkpoint)
            self._models.events.checkpoint_deleted(checkpoint_info(checkpoint), row.policy_version)
        await self._models.delete_tinker_paths([checkpoint.tinker_path])


def kind_word(kind: types_pb2.CheckpointKind.ValueType) -> str:
    """A checkpoint kind as messages say it ("state", "sampler"), not as the enum spells it."""
    return types_pb2.CheckpointKind.Name(kind).removeprefix("CHECKPOINT_KIND_").lower()
