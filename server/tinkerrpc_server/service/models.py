"""The model registry: each model's in-memory runtime (step lock, training client, dirty flag), the
sampling clients by tinker:// path, rebuilding a training client (recovery point + replayed steps),
ModelInfo, and creating and deleting models. Every other room reaches models and their clients through it."""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import TypedDict

import tinker
from google.protobuf import timestamp_pb2

from tinkerrpc.contract.limits import DEFAULT_LORA_RANK
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import model_store
from tinkerrpc_server.service import errors, recovery
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.deadlines import bounded
from tinkerrpc_server.service.events import ModelEvents
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.rendering import (
    ChatCodec,
    ChatCodecs,
    UnknownRendererError,
    default_renderer_name,
    off_loop,
)
from tinkerrpc_server.service.retention import Retention, unload_training_client
from tinkerrpc_server.service.sample_cache import SampleCache
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, CheckpointRow, ModelRow, Store
from tinkerrpc_server.service.validation import check_lora_rank

log = logging.getLogger("tinkerrpc.service")

MODEL_RESOURCE = "tinkerrpc.v1.Model"
CHECKPOINT_RESOURCE = "tinkerrpc.v1.Checkpoint"
VERSION_RESOURCE = "tinkerrpc.v1.PolicyVersion"
BASE_MODEL_RESOURCE = "tinkerrpc.v1.BaseModel"


def sampler_name(version: int) -> str:
    return f"v{version:06d}"


def state_name(version: int) -> str:
    return f"step_{version:06d}"


def timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def checkpoint_info(row: CheckpointRow) -> types_pb2.CheckpointInfo:
    return types_pb2.CheckpointInfo(
        model=row.model,
        name=row.name,
        policy_version=row.policy_version,
        kind=row.kind,  # type: ignore[arg-type]
        tinker_path=row.tinker_path,
        create_time=timestamp(row.create_time),
        automatic=row.automatic,
    )


class _LoraFlags(TypedDict):
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


def lora_flags(lora: types_pb2.LoraConfig) -> _LoraFlags:
    """Which modules the adapter trains; an unset flag means True."""
    return {
        "train_mlp": lora.train_mlp if lora.HasField("train_mlp") else True,
        "train_attn": lora.train_attn if lora.HasField("train_attn") else True,
        "train_unembed": lora.train_unembed if lora.HasField("train_unembed") else True,
    }


def _shown(value: str | int | bool) -> str:
    return errors.shown(value) if isinstance(value, str) else str(value)


async def made_or_freed(making: Awaitable[tinker.TrainingClient], operation: str) -> tinker.TrainingClient:
    """The training client `making` makes, bounded by the call's deadline. A call that ends first (its
    deadline, a cancel) does not cancel the making: the backend may already be building the client, so it
    is let finish and then unloaded, instead of living on the engine unreferenced until shutdown."""

    async def make() -> tinker.TrainingClient:
        return await making

    made = asyncio.ensure_future(make())
    try:
        return await bounded(asyncio.shield(made), operation)
    except BaseException:
        made.add_done_callback(_unload_if_made)
        raise


def _unload_if_made(made: asyncio.Future[tinker.TrainingClient]) -> None:
    if not made.cancelled() and made.exception() is None:
        unload_training_client(made.result())


@dataclass
class ModelRuntime:
    """In-memory state of one model: its step lock (FIFO: arrival order), training client and dirty flag."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    training_client: tinker.TrainingClient | None = None
    # Work was submitted to the training client and not committed: reload before training again.
    dirty: bool = False
    # What the last commit left to tidy on the backend (see ModelRegistry.tidy_after_commit).
    tidying: asyncio.Future[None] | None = None


class ModelRegistry:
    def __init__(
        self, store: Store, backend: Backend, codecs: ChatCodecs, limits: Limits, sample_cache: SampleCache
    ) -> None:
        self._store = store
        self._backend = backend
        self._codecs = codecs
        # What Sample drew, by sample key: what a restore or delete discards goes from it too.
        self.sample_cache = sample_cache
        self.retention = Retention(store, backend, limits)
        self._runtimes: dict[str, ModelRuntime] = {row.name: ModelRuntime() for row in store.list_models()}
        self._sampling_clients: dict[str, asyncio.Task[tinker.SamplingClient]] = {}
        # What WatchModel streams: the rooms that change a model publish to it after their commit.
        self.events = ModelEvents()

    def row(self, name: str) -> ModelRow:
        row = self._store.get_model(name)
        if row is None:
            raise errors.not_found(MODEL_RESOURCE, name, f"model {errors.shown(name)} not found")
        return row

    def runtime(self, name: str) -> ModelRuntime:
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise errors.not_found(MODEL_RESOURCE, name, f"model {errors.shown(name)} not found")
        return runtime

    async def codec(self, row: ModelRow) -> ChatCodec:
        # Loading takes the rendering thread; a loaded codec (every call after the first) needs no hop there.
        loaded = self._codecs.loaded(row.base_model, row.renderer)
        if loaded is not None:
            return loaded
        return await off_loop(lambda: self._codecs.get(row.base_model, row.renderer))

    def base_codec(self, base_model: str) -> ChatCodec:
        """A base model's codec with its recommended renderer (on the rendering thread: off_loop)."""
        return self._codecs.get(base_model)

    def info(self, row: ModelRow) -> types_pb2.ModelInfo:
        keep_samplers, keep_states = self.retention.policy(row)
        return types_pb2.ModelInfo(
            name=row.name,
            base_model=row.base_model,
            lora=types_pb2.LoraConfig(
                rank=row.lora_rank,
                train_mlp=row.train_mlp,
                train_attn=row.train_attn,
                train_unembed=row.train_unembed,
            ),
            renderer=row.renderer,
            policy_version=row.policy_version,
            sampleable_versions=self._store.sampleable_versions(row.name),
            create_time=timestamp(row.create_time),
            seed=row.seed,
            tinker_run_id=row.tinker_run_id,
            vocab_size=row.vocab_size,
            max_context_length=row.max_context_length,
            keep_sampler_versions=keep_samplers,
            keep_state_checkpoints=keep_states,
            checkpoint_bytes=self._store.checkpoint_bytes(row.name),
        )

    def infos(self) -> list[types_pb2.ModelInfo]:
        return [self.info(row) for row in self._store.list_models()]

    def tidy_after_commit(self, runtime: ModelRuntime, name: str, pruned: list[str], run_id: str) -> None:
        """Delete the files of the checkpoints a commit pruned and read the sizes of those it made, after
        the response: both talk to the backend (a few round trips, ~15 ms a step on the local engine) and
        neither changes what is committed. One model's tidying runs in commit order, one at a time."""
        previous = runtime.tidying

        async def tidy() -> None:
            if previous is not None:
                await previous
            await self.delete_tinker_paths(pruned)
            await self.retention.record_sizes(name, run_id)

        runtime.tidying = asyncio.ensure_future(tidy())

    async def tidied(self, name: str) -> None:
        """Wait until the tidying of the model's last commit is done (what reads sizes waits here)."""
        runtime = self._runtimes.get(name)
        if runtime is not None and runtime.tidying is not None:
            await asyncio.shield(runtime.tidying)

    async def tidy_all(self) -> None:
        """Let every model's tidying finish (the server waits here before it stops)."""
        pending = [r.tidying for r in self._runtimes.values() if r.tidying is not None]
        await asyncio.gather(*pending, return_exceptions=True)

    async def delete_tinker_paths(self, paths: list[str]) -> None:
        """Best effort: a file left behind wastes space but never breaks a committed state."""
        for path in paths:
            self._sampling_clients.pop(path, None)
            try:
                await self.retention.delete_path(path)
            except Exception as err:
                log.warning("could not delete %s from the backend: %s", path, err)

    async def sampling_client(self, path: str | None, base_model: str | None = None) -> tinker.SamplingClient:
        """The sampler of checkpoint weights at `path`, or (path None) of `base_model` without an adapter."""
        key = path or f"base_model:{base_model}"
        task = self._sampling_clients.get(key)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):

            async def create() -> tinker.SamplingClient:
                # The SDK's future declares `__await__` as returning Any.
                client: tinker.SamplingClient = await self._backend.service.create_sampling_client(
                    model_path=path, base_model=None if path else base_model
                )
                return client

            task = asyncio.ensure_future(create())
            self._sampling_clients[key] = task
        return await asyncio.shield(task)

    def discard_training_client(self, runtime: ModelRuntime) -> None:
        """Forget uncommitted work: the training client goes (unloaded), and its next use rebuilds the
        current version from the recovery point and the recorded steps after it."""
        dropped, runtime.training_client = runtime.training_client, None
        runtime.dirty = False
        if dropped is not None:
            unload_training_client(dropped)

    async def training_client(self, name: str, runtime: ModelRuntime) -> tinker.TrainingClient:
        if runtime.dirty:
            self.discard_training_client(runtime)
        if runtime.training_client is None:
            row = self.row(name)
            client = await made_or_freed(
                self._backend.service.create_training_client_from_state_with_optimizer(row.recovery_path),
                "loading the training client",
            )
            try:
                await recovery.replay(self._store, row, client)
            except BaseException:
                unload_training_client(client)
                raise
            self._store.set_run_id(name, str(client.model_id))
            runtime.training_client = client
            log.info(
                "model %s: training client %s loaded from %s at version %d",
                name,
                client.model_id,
                row.recovery_path,
                row.policy_version,
            )
        return runtime.training_client

    async def recover(self) -> None:
        """At start-up: every model stays at its committed version (its training client is rebuilt on
        first use), unless step records are missing (a database of an older release): then it goes back
        to the newest version they rebuild. The checkpoint files no row references (steps that never
        committed) are deleted."""
        for row in self._store.list_models():
            rebuilt = recovery.replayable_version(self._store, row)
            if rebuilt < row.policy_version:
                with self._store.transaction() as tx:
                    stale_paths = self._store.roll_back(tx, row.name, rebuilt)
                log.warning(
                    "model %s: versions after %d have no step records; rolled back from version %d",
                    row.name,
                    rebuilt,
                    row.policy_version,
                )
                await self.delete_tinker_paths(stale_paths)
        known = {
            c.tinker_path for row in self._store.list_models() for c in self._store.list_checkpoints(row.name)
        }
        for row in self._store.list_models():
            orphans = await self.retention.orphans(row, known)
            if orphans:
                log.info("model %s: deleting %d checkpoints of uncommitted steps", row.name, len(orphans))
                await self.delete_tinker_paths(orphans)

    def drop_sampling_clients(self) -> None:
        """The engine died: its sampling clients (and those being made) are useless."""
        for pending in self._sampling_clients.values():
            pending.cancel()
        self._sampling_clients.clear()

    async def reload_all(self) -> int:
        """After an engine restart: every model's training client is rebuilt on next use, once its lock
        is free (the interrupted calls release the locks as they unwind). The number of models."""
        for runtime in list(self._runtimes.values()):
            async with runtime.lock:
                runtime.training_client = None  # it died with its engine: nothing to unload
                runtime.dirty = False
        return len(self._runtimes)

    async def create(self, request: pb.CreateModelRequest) -> types_pb2.ModelInfo:
        """A validated request's model at version 0 (sampleable and recoverable from the start); with
        exist_ok, the model of that name as it is when it has the requested shape."""
        existing = self._runtimes.get(request.name)
        if existing is not None:
            if not request.exist_ok:
                raise errors.already_exists(
                    MODEL_RESOURCE, request.name, f"model {request.name!r} already exists"
                )
            row = self._store.get_model(request.name)
            if row is None:
                # Being created: wait until that settles (it may fail, and then the name is free).
                async with existing.lock:
                    row = self._store.get_model(request.name)
            if row is not None:
                return await self._existing(request, row)
            if request.name in self._runtimes:
                raise errors.already_exists(
                    MODEL_RESOURCE, request.name, f"model {request.name!r} is being created or deleted"
                )
        runtime = ModelRuntime()
        self._runtimes[request.name] = runtime
        try:
            async with runtime.lock:
                return await self._create(request, runtime)
        except BaseException:
            self._runtimes.pop(request.name, None)
            raise

    async def _existing(self, request: pb.CreateModelRequest, row: ModelRow) -> types_pb2.ModelInfo:
        """exist_ok: the existing model when it matches the request's base model, LoRA shape and
        renderer; ALREADY_EXISTS naming every difference otherwise."""
        wanted_renderer = request.renderer
        if not wanted_renderer and request.base_model == row.base_model:
            try:
                wanted_renderer = await off_loop(lambda: default_renderer_name(row.base_model))
            except UnknownRendererError as err:
                raise errors.invalid_argument([("renderer", str(err))]) from err
        flags = lora_flags(request.lora)
        requested: dict[str, str | int | bool] = {
            "base_model": request.base_model,
            "lora.rank": request.lora.rank or DEFAULT_LORA_RANK,
            "lora.train_mlp": flags["train_mlp"],
            "lora.train_attn": flags["train_attn"],
            "lora.train_unembed": flags["train_unembed"],
            "renderer": wanted_renderer or row.renderer,
        }
        existing: dict[str, str | int | bool] = {
            "base_model": row.base_model,
            "lora.rank": row.lora_rank,
            "lora.train_mlp": row.train_mlp,
            "lora.train_attn": row.train_attn,
            "lora.train_unembed": row.train_unembed,
            "renderer": row.renderer,
        }
        differences = [
            f"{key} is {_shown(existing[key])}, not {_shown(value)}"
            for key, value in requested.items()
            if existing[key] != value
        ]
        if differences:
            raise errors.already_exists(
                MODEL_RESOURCE,
                request.name,
                f"model {request.name!r} already exists with a different shape: " + "; ".join(differences),
            )
        return self.info(row)

    async def _create(self, request: pb.CreateModelRequest, runtime: ModelRuntime) -> types_pb2.ModelInfo:
        try:
            codec = await off_loop(lambda: self._codecs.get(request.base_model, request.renderer))
        except model_store.UnknownBaseModelError as err:
            raise errors.not_found(BASE_MODEL_RESOURCE, request.base_model, str(err)) from err
        except UnknownRendererError as err:
            raise errors.invalid_argument([("renderer", str(err))]) from err
        lora = request.lora
        rank = lora.rank or DEFAULT_LORA_RANK
        check_lora_rank(rank, request.base_model, codec.hidden_size)
        seed = request.seed if request.HasField("seed") else 0
        flags = lora_flags(lora)
        client = await made_or_freed(
            self._backend.service.create_lora_training_client(
                request.base_model,
                rank=rank,
                seed=seed,
                user_metadata={"tinkerrpc_model": request.name},
                **flags,
            ),
            "creating the training client",
        )
        try:
            state_future = client.save_state(state_name(0))
            sampler_future = client.save_weights_for_sampler(sampler_name(0))
            state_path = (await state_future).path
            sampler_path = (await sampler_future).path
        except BaseException:
            unload_training_client(client)  # the model is not created: nothing else refers to it
            raise
        now = time.time()
        row = ModelRow(
            name=request.name,
            base_model=request.base_model,
            lora_rank=rank,
            renderer=codec.renderer_name,
            seed=seed,
            vocab_size=codec.vocab_size,
            max_context_length=codec.max_context_length,
            create_time=now,
            tinker_run_id=str(client.model_id),
            policy_version=0,
            recovery_version=0,
            recovery_path=state_path,
            keep_sampler_versions=(
                request.keep_sampler_versions if request.HasField("keep_sampler_versions") else None
            ),
            keep_state_checkpoints=(
                request.keep_state_checkpoints if request.HasField("keep_state_checkpoints") else None
            ),
            **flags,
        )
        with self._store.transaction() as tx:
            self._store.insert_model(row, tx)
            self._store.put_checkpoint(
                tx, CheckpointRow(request.name, KIND_STATE, state_name(0), 0, state_path, now, True)
            )
            self._store.put_checkpoint(
                tx, CheckpointRow(request.name, KIND_SAMPLER, sampler_name(0), 0, sampler_path, now, True)
            )
        runtime.training_client = client
        log.info("created model %s on %s (run %s)", request.name, request.base_model, client.model_id)
        return self.info(row)

    async def delete(self, name: str) -> None:
        runtime = self.runtime(name)
        async with runtime.lock:
            self.row(name)
            await self.tidied(name)
            paths = [row.tinker_path for row in self._store.list_checkpoints(name)]
            self._store.delete_model(name)
            self.sample_cache.discard(name)
            self._runtimes.pop(name, None)
        if runtime.training_client is not None:
            unload_training_client(runtime.training_client)
        await self.delete_tinker_paths(paths)
        log.info("deleted model %s", name)
