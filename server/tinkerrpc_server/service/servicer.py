"""tinkerrpc.v1.TrainerService over the tinker SDK.

State lives in SQLite (store.py); the Tinker backend (Tinker itself or the embedded engine) holds the
weights. One Train step on model M at version N:
  validate → build datums → forward_backward, optim_step, save_weights_for_sampler("vNNNNNN") and,
  every --checkpoint-every steps, save_state("step_NNNNNN"), all submitted at once (the SDK orders
  them by sequence id) → ONE transaction commits version N+1, the checkpoint rows, the metrics and
  the idempotency record → respond.
A step that fails or is cancelled after it submitted work marks the model dirty; the next call that
trains first rolls back to the recovery point (the last committed state checkpoint) and reloads the
training client from it. Restart recovery does the same for every model. With --checkpoint-every K > 1
the recovery point can be up to K-1 versions behind: those versions are rolled back (samplers, metrics,
idempotency records) so version, weights and optimizer state always agree.

Engine supervision (embedded engine only): when the engine child exits, calls in flight fail UNAVAILABLE,
new calls wait (within their deadline) while a new engine starts on a fresh port; every model then goes
to its recovery point and reloads its training client from that state checkpoint (with optimizer) on next
use; sampling clients are made anew from the same tinker:// paths, as the engine's data dir persists.

Test-only fault injection: TINKERRPC_TEST_CRASH_AT=after_optim|after_sampler_save|before_commit|
after_commit makes the process os._exit(137) at that point of a Train step (like a SIGKILL).
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import logging
import math
import os
import tempfile
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypedDict, TypeVar

import grpc
import httpx
import tinker
from google.protobuf import timestamp_pb2

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2
from tinkerrpc_server import model_store
from tinkerrpc_server.local.engine_process import BackendStartError
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.datums import Batch, rl_batch, sft_batch
from tinkerrpc_server.service.errors import ServiceError, Violations
from tinkerrpc_server.service.limits import Limits, flag_of
from tinkerrpc_server.service.rendering import (
    ChatCodec,
    ChatCodecs,
    UnknownRendererError,
    check_messages,
    check_tools,
    to_cookbook_messages,
    to_proto_message,
)
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, CheckpointRow, ModelRow, Store
from tinkerrpc_server.service.validation import check_name, check_train_request, loss_name

log = logging.getLogger("tinkerrpc.service")

CRASH_POINTS = ("after_optim", "after_sampler_save", "before_commit", "after_commit")
DEFAULT_LORA_RANK = 32
MODEL_RESOURCE = "tinkerrpc.v1.Model"
CHECKPOINT_RESOURCE = "tinkerrpc.v1.Checkpoint"
VERSION_RESOURCE = "tinkerrpc.v1.PolicyVersion"
ENGINE_POLL_SECONDS = 0.2
# Restarts of a dead engine in a row before the server gives up and stops.
ENGINE_RESTART_ATTEMPTS = 3
# Longest a call waits for a restarting engine when it has no deadline of its own.
ENGINE_RESTART_WAIT_SECONDS = 240.0

Request = TypeVar("Request")
Response = TypeVar("Response")
Result = TypeVar("Result")
# ExportWeights streams files in pieces of this size.
EXPORT_CHUNK_BYTES = 1 << 20
# Longest a single exported file may take to come from the backend.
EXPORT_DOWNLOAD_TIMEOUT_SECONDS = 600.0


def sampler_name(version: int) -> str:
    return f"v{version:06d}"


def state_name(version: int) -> str:
    return f"step_{version:06d}"


def rpc(
    method: Callable[
        [TrainerService, Request, grpc.aio.ServicerContext[Request, Response]], Awaitable[Result]
    ],
) -> Callable[[TrainerService, Request, grpc.aio.ServicerContext[Request, Response]], Awaitable[Result]]:
    """Turns ServiceError and tinker SDK errors into the call's status with google.rpc details; a call
    cut short by the engine child dying fails UNAVAILABLE (retryable), whatever error it was in.
    A unary RPC returns its response; a streaming RPC's preparation step returns what it streams."""

    @functools.wraps(method)
    async def handler(
        self: TrainerService, request: Request, context: grpc.aio.ServicerContext[Request, Response]
    ) -> Result:
        task = asyncio.current_task()
        assert task is not None
        generation = self._engine_generation
        try:
            await self._wait_engine_ready(context)
            self._calls.add(task)
            return await method(self, request, context)
        except ServiceError as err:
            error = err
        except asyncio.CancelledError:
            if task not in self._interrupted:
                raise  # the client cancelled, or its deadline passed: nobody waits for an answer
            task.uncancel()
            error = _engine_lost()
        except Exception as err:
            if self._engine_generation != generation or self._engine_down():
                error = _engine_lost()
            elif isinstance(err, tinker.TinkerError):
                error = errors.from_tinker(err) or ServiceError(
                    grpc.StatusCode.INTERNAL, f"Tinker error: {err}"
                )
            else:
                log.exception("%s failed", method.__name__)
                error = ServiceError(grpc.StatusCode.INTERNAL, f"{type(err).__name__}: {err}")
        finally:
            self._calls.discard(task)
            self._interrupted.discard(task)
        # grpc-stubs' aio.ServicerContext lacks abort_with_status (grpc.aio has it since 1.38).
        await context.abort_with_status(error.to_status())  # type: ignore[attr-defined]
        raise AssertionError("abort_with_status returned")  # pragma: no cover - it always raises

    return handler


def _check_expected_version(row: ModelRow, request: pb.TrainRequest | pb.ExportWeightsRequest) -> None:
    if request.HasField("expected_policy_version") and request.expected_policy_version != row.policy_version:
        raise errors.failed_precondition(
            errors.VERSION_MISMATCH,
            f"model {row.name!r} is at version {row.policy_version}, "
            f"not the expected {request.expected_policy_version}",
            {"current_version": row.policy_version, "expected_version": request.expected_policy_version},
        )


@dataclass
class _Export:
    """An export fetched from the backend into a local directory, ready to stream."""

    weights: types_pb2.ExportedWeights
    directory: tempfile.TemporaryDirectory[str]


async def _download(http: httpx.AsyncClient, url: str, directory: Path, relative: str) -> int:
    """Stream one exported file from the backend to `directory`/`relative`; its size."""
    target = (directory / relative).resolve()
    if not target.is_relative_to(directory.resolve()):
        raise ServiceError(grpc.StatusCode.INTERNAL, f"the backend exported an unsafe file path {relative!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    async with http.stream("GET", url) as response:
        if response.status_code != 200:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"downloading exported file {relative!r} from the backend failed: HTTP {response.status_code}",
            )
        with open(target, "wb") as handle:
            async for data in response.aiter_bytes(EXPORT_CHUNK_BYTES):
                handle.write(data)
                size += len(data)
    return size


class _LoraFlags(TypedDict):
    train_mlp: bool
    train_attn: bool
    train_unembed: bool


def _engine_lost() -> ServiceError:
    return ServiceError(
        grpc.StatusCode.UNAVAILABLE,
        "the embedded engine stopped during this call and is being restarted: retry it (a Train retried "
        "with its idempotency key is applied at most once)",
    )


@dataclass
class ModelRuntime:
    """In-memory state of one model: its step lock (FIFO: arrival order), training client and dirty flag."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    training_client: tinker.TrainingClient | None = None
    # Work was submitted to the training client and not committed: reload before training again.
    dirty: bool = False


def _timestamp(seconds: float) -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(int(seconds * 1e9))
    return stamp


def _checkpoint_info(row: CheckpointRow) -> types_pb2.CheckpointInfo:
    return types_pb2.CheckpointInfo(
        model=row.model,
        name=row.name,
        policy_version=row.policy_version,
        kind=row.kind,  # type: ignore[arg-type]
        tinker_path=row.tinker_path,
        create_time=_timestamp(row.create_time),
        automatic=row.automatic,
    )


def _request_hash(request: pb.TrainRequest) -> str:
    keyless = pb.TrainRequest()
    keyless.CopyFrom(request)
    keyless.idempotency_key = ""
    return hashlib.sha256(keyless.SerializeToString(deterministic=True)).hexdigest()


def _loss_config(loss: types_pb2.LossConfig, name: str) -> dict[str, float] | None:
    if name in ("ppo", "cispo"):
        return {
            "clip_low_threshold": loss.clip_low_threshold if loss.HasField("clip_low_threshold") else 0.8,
            "clip_high_threshold": loss.clip_high_threshold if loss.HasField("clip_high_threshold") else 1.2,
        }
    if name == "dro":
        return {"beta": loss.beta if loss.HasField("beta") else 0.05}
    return None


def _adam(adam: types_pb2.AdamParams) -> tinker.types.AdamParams:
    return tinker.types.AdamParams(
        learning_rate=adam.learning_rate,
        beta1=adam.beta1 if adam.HasField("beta1") else 0.9,
        beta2=adam.beta2 if adam.HasField("beta2") else 0.95,
        eps=adam.eps if adam.HasField("eps") else 1e-12,
        weight_decay=adam.weight_decay,
        grad_clip_norm=adam.grad_clip_norm,
    )


class TrainerService(trainer_service_pb2_grpc.TrainerServiceServicer):
    def __init__(
        self, store: Store, backend: Backend, codecs: ChatCodecs, checkpoint_every: int, limits: Limits
    ) -> None:
        self._store = store
        self._backend = backend
        self._codecs = codecs
        self._checkpoint_every = checkpoint_every
        self._limits = limits
        # Engine supervision: calls in flight (cancelled when the engine dies), those cancelled that way,
        # and a generation that counts engine restarts.
        self._calls: set[asyncio.Task[Any]] = set()
        self._interrupted: set[asyncio.Task[Any]] = set()
        self._engine_generation = 0
        self._engine_ready = asyncio.Event()
        self._engine_ready.set()
        self._runtimes: dict[str, ModelRuntime] = {row.name: ModelRuntime() for row in store.list_models()}
        self._sampling_clients: dict[str, asyncio.Task[tinker.SamplingClient]] = {}
        self._crash_at = os.environ.get("TINKERRPC_TEST_CRASH_AT", "")

    # ---- helpers

    def _crash_point(self, point: str) -> None:
        if self._crash_at == point:
            log.warning("TINKERRPC_TEST_CRASH_AT=%s: exiting now", point)
            os._exit(137)

    def _model(self, name: str) -> ModelRow:
        row = self._store.get_model(name)
        if row is None:
            raise errors.not_found(MODEL_RESOURCE, name, f"model {name!r} not found")
        return row

    def _runtime(self, name: str) -> ModelRuntime:
        runtime = self._runtimes.get(name)
        if runtime is None:
            raise errors.not_found(MODEL_RESOURCE, name, f"model {name!r} not found")
        return runtime

    async def _codec(self, row: ModelRow) -> ChatCodec:
        return await asyncio.to_thread(self._codecs.get, row.base_model, row.renderer)

    def _model_info(self, row: ModelRow) -> types_pb2.ModelInfo:
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
            create_time=_timestamp(row.create_time),
            seed=row.seed,
            tinker_run_id=row.tinker_run_id,
            vocab_size=row.vocab_size,
            max_context_length=row.max_context_length,
        )

    async def _delete_tinker_paths(self, paths: list[str]) -> None:
        """Best effort: a file left behind wastes space but never breaks a committed state."""
        for path in paths:
            self._sampling_clients.pop(path, None)
            try:
                await self._backend.rest.delete_checkpoint_from_tinker_path(path)
            except Exception as err:
                log.warning("could not delete %s from the backend: %s", path, err)

    async def _sampling_client(self, path: str) -> tinker.SamplingClient:
        task = self._sampling_clients.get(path)
        if task is None or (task.done() and (task.cancelled() or task.exception() is not None)):

            async def create() -> tinker.SamplingClient:
                # The SDK's future declares `__await__` as returning Any.
                client: tinker.SamplingClient = await self._backend.service.create_sampling_client(
                    model_path=path
                )
                return client

            task = asyncio.ensure_future(create())
            self._sampling_clients[path] = task
        return await asyncio.shield(task)

    async def _roll_back_to_recovery_point(self, name: str, runtime: ModelRuntime) -> None:
        """Forget uncommitted work: versions after the last committed state checkpoint go, and the
        training client is reloaded from that checkpoint on next use."""
        row = self._model(name)
        with self._store.transaction() as tx:
            stale_paths = self._store.roll_back(tx, name, row.recovery_version)
        if row.policy_version != row.recovery_version:
            log.warning(
                "model %s: rolled back from version %d to its recovery point %d",
                name,
                row.policy_version,
                row.recovery_version,
            )
        runtime.training_client = None
        runtime.dirty = False
        await self._delete_tinker_paths(stale_paths)

    async def _training_client(self, name: str, runtime: ModelRuntime) -> tinker.TrainingClient:
        if runtime.dirty:
            await self._roll_back_to_recovery_point(name, runtime)
        if runtime.training_client is None:
            row = self._model(name)
            client = await self._backend.service.create_training_client_from_state_with_optimizer(
                row.recovery_path
            )
            self._store.set_run_id(name, str(client.model_id))
            runtime.training_client = client
            log.info("model %s: training client %s loaded from %s", name, client.model_id, row.recovery_path)
        return runtime.training_client

    async def recover(self) -> None:
        """At start-up: every model goes to its recovery point (a no-op when each step saved state)."""
        for name, runtime in self._runtimes.items():
            await self._roll_back_to_recovery_point(name, runtime)

    # ---- engine supervision

    def _engine_down(self) -> bool:
        engine = self._backend.engine
        return not self._engine_ready.is_set() or (engine is not None and engine.exit_code() is not None)

    async def _wait_engine_ready(self, context: grpc.aio.ServicerContext[Any, Any]) -> None:
        if self._engine_ready.is_set():
            return
        remaining = context.time_remaining()
        wait = (
            ENGINE_RESTART_WAIT_SECONDS if remaining is None else min(remaining, ENGINE_RESTART_WAIT_SECONDS)
        )
        try:
            await asyncio.wait_for(self._engine_ready.wait(), wait)
        except TimeoutError:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE, "the embedded engine is restarting; retry shortly"
            ) from None

    @property
    def supervises_engine(self) -> bool:
        return self._backend.engine is not None

    async def supervise_engine(self, report_serving: Callable[[bool], Awaitable[None]]) -> None:
        """Runs for the server's lifetime (embedded engine only): restarts the engine child whenever it
        exits, reporting not serving for the restart window. Returns only after ENGINE_RESTART_ATTEMPTS
        failed restarts in a row (the server then stops)."""
        engine = self._backend.engine
        assert engine is not None, "only the embedded engine is supervised"
        while True:
            await asyncio.sleep(ENGINE_POLL_SECONDS)
            exit_code = engine.exit_code()
            if exit_code is None:
                continue
            log.error("embedded engine (pid %s) exited with code %d; restarting it", engine.pid, exit_code)
            await report_serving(False)
            for attempt in range(1, ENGINE_RESTART_ATTEMPTS + 1):
                try:
                    await self._restart_engine()
                    await report_serving(True)
                    break
                except BackendStartError as err:
                    log.error("engine restart %d/%d failed: %s", attempt, ENGINE_RESTART_ATTEMPTS, err)
            else:
                return

    async def _restart_engine(self) -> None:
        started = time.monotonic()
        self._engine_ready.clear()
        self._engine_generation += 1
        for task in self._calls - self._interrupted:
            self._interrupted.add(task)
            task.cancel()
        for pending in self._sampling_clients.values():
            pending.cancel()
        self._sampling_clients.clear()
        await self._backend.restart_engine()
        for name, runtime in list(self._runtimes.items()):
            # The interrupted calls release the locks as they unwind.
            async with runtime.lock:
                if self._store.get_model(name) is not None:
                    await self._roll_back_to_recovery_point(name, runtime)
        self._engine_ready.set()
        log.warning(
            "embedded engine restarted (pid %s) in %.1fs; %d models reload from their recovery points",
            self._backend.engine.pid if self._backend.engine else None,
            time.monotonic() - started,
            len(self._runtimes),
        )

    # ---- models

    @rpc
    async def CreateModel(
        self,
        request: pb.CreateModelRequest,
        context: grpc.aio.ServicerContext[pb.CreateModelRequest, pb.CreateModelResponse],
    ) -> pb.CreateModelResponse:
        v = Violations()
        check_name(v, "name", request.name)
        if not request.base_model:
            v.add("base_model", "required")
        if request.lora.rank < 0:
            v.add("lora.rank", "must be > 0 (0 = default 32)")
        v.raise_if_any()
        if request.name in self._runtimes:
            raise errors.already_exists(
                MODEL_RESOURCE, request.name, f"model {request.name!r} already exists"
            )
        runtime = ModelRuntime()
        self._runtimes[request.name] = runtime
        try:
            async with runtime.lock:
                return await self._create_model(request, runtime)
        except BaseException:
            self._runtimes.pop(request.name, None)
            raise

    async def _create_model(
        self, request: pb.CreateModelRequest, runtime: ModelRuntime
    ) -> pb.CreateModelResponse:
        try:
            codec = await asyncio.to_thread(self._codecs.get, request.base_model, request.renderer)
        except model_store.UnknownBaseModelError as err:
            raise errors.invalid_argument([("base_model", str(err))]) from err
        except UnknownRendererError as err:
            raise errors.invalid_argument([("renderer", str(err))]) from err
        lora = request.lora
        rank = lora.rank or DEFAULT_LORA_RANK
        seed = request.seed if request.HasField("seed") else 0
        flags: _LoraFlags = {
            "train_mlp": lora.train_mlp if lora.HasField("train_mlp") else True,
            "train_attn": lora.train_attn if lora.HasField("train_attn") else True,
            "train_unembed": lora.train_unembed if lora.HasField("train_unembed") else True,
        }
        client = await self._backend.service.create_lora_training_client(
            request.base_model, rank=rank, seed=seed, user_metadata={"tinkerrpc_model": request.name}, **flags
        )
        # Version 0 is sampleable and recoverable from the start.
        state_future = client.save_state(state_name(0))
        sampler_future = client.save_weights_for_sampler(sampler_name(0))
        state_path = (await state_future).path
        sampler_path = (await sampler_future).path
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
        return pb.CreateModelResponse(model=self._model_info(row))

    @rpc
    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        return pb.GetModelResponse(model=self._model_info(self._model(request.name)))

    @rpc
    async def ListModels(
        self,
        request: pb.ListModelsRequest,
        context: grpc.aio.ServicerContext[pb.ListModelsRequest, pb.ListModelsResponse],
    ) -> pb.ListModelsResponse:
        return pb.ListModelsResponse(models=[self._model_info(row) for row in self._store.list_models()])

    @rpc
    async def DeleteModel(
        self,
        request: pb.DeleteModelRequest,
        context: grpc.aio.ServicerContext[pb.DeleteModelRequest, pb.DeleteModelResponse],
    ) -> pb.DeleteModelResponse:
        runtime = self._runtime(request.name)
        async with runtime.lock:
            self._model(request.name)
            paths = [row.tinker_path for row in self._store.list_checkpoints(request.name)]
            self._store.delete_model(request.name)
            self._runtimes.pop(request.name, None)
        await self._delete_tinker_paths(paths)
        log.info("deleted model %s", request.name)
        return pb.DeleteModelResponse()

    # ---- train

    @rpc
    async def Train(
        self, request: pb.TrainRequest, context: grpc.aio.ServicerContext[pb.TrainRequest, pb.TrainResponse]
    ) -> pb.TrainResponse:
        runtime = self._runtime(request.model)
        self._check_train_size(request)
        request_hash = _request_hash(request) if request.idempotency_key else ""
        # Steps on one model queue here in arrival order; a retry of a running step waits for it and
        # then finds its record.
        async with runtime.lock:
            started = time.monotonic()
            row = self._model(request.model)
            if request.idempotency_key:
                record = self._store.get_idempotency(request.model, request.idempotency_key)
                if record is not None:
                    if record.request_hash != request_hash:
                        raise errors.failed_precondition(
                            errors.IDEMPOTENCY_KEY_REUSED,
                            f"idempotency key {request.idempotency_key!r} was used for a different request",
                            {
                                "idempotency_key": request.idempotency_key,
                                "policy_version": record.policy_version,
                            },
                        )
                    replay = pb.TrainResponse.FromString(record.response)
                    replay.replayed = True
                    return replay
            _check_expected_version(row, request)
            codec = await self._codec(row)
            check_train_request(request, row.policy_version, codec.vocab_size)
            batch = (
                rl_batch(request, row.policy_version, codec) if request.groups else sft_batch(request, codec)
            )
            if not batch.datums:
                raise errors.failed_precondition(
                    errors.NOTHING_TO_TRAIN,
                    "nothing left to train after dropping stale trajectories and zero-variance groups; "
                    "the model was not changed",
                    {
                        "dropped_stale": batch.dropped_stale,
                        "dropped_zero_variance": batch.dropped_zero_variance,
                        "zero_variance_groups": batch.zero_variance_groups,
                    },
                )
            if batch.total_tokens > self._limits.max_train_tokens:
                raise errors.resource_exhausted(
                    flag_of("max_train_tokens"),
                    f"the batch has {batch.total_tokens} tokens; this server takes at most "
                    f"{self._limits.max_train_tokens} per Train (--max-train-tokens): split it",
                )
            client = await self._training_client(request.model, runtime)
            runtime.dirty = True
            try:
                response = await self._run_step(request, row, client, batch, started)
            except asyncio.CancelledError:
                log.warning(
                    "model %s: Train cancelled mid-step (deadline, client or engine loss); nothing committed, "
                    "the model rolls back to version %d before its next step",
                    row.name,
                    row.policy_version,
                )
                raise
            runtime.dirty = False
            self._crash_point("after_commit")
            return response

    def _check_train_size(self, request: pb.TrainRequest) -> None:
        count = sum(len(group.trajectories) for group in request.groups) + len(request.examples)
        if count > self._limits.max_train_trajectories:
            raise errors.resource_exhausted(
                flag_of("max_train_trajectories"),
                f"the batch has {count} trajectories/examples; this server takes at most "
                f"{self._limits.max_train_trajectories} per Train (--max-train-trajectories): split it",
            )

    async def _run_step(
        self,
        request: pb.TrainRequest,
        row: ModelRow,
        client: tinker.TrainingClient,
        batch: Batch,
        started: float,
    ) -> pb.TrainResponse:
        name = row.name
        version = row.policy_version + 1
        loss = loss_name(request)
        save_state = version % self._checkpoint_every == 0
        forward_backward = client.forward_backward(batch.datums, loss, _loss_config(request.loss, loss))
        optim_step = client.optim_step(_adam(request.adam))
        sampler_save = client.save_weights_for_sampler(sampler_name(version))
        state_save = client.save_state(state_name(version)) if save_state else None
        fb_output = await forward_backward
        optim_output = await optim_step
        self._crash_point("after_optim")
        sampler_path = (await sampler_save).path
        self._crash_point("after_sampler_save")
        state_path = (await state_save).path if state_save is not None else None
        step_seconds = time.monotonic() - started

        trainer_metrics = {**fb_output.metrics, **(optim_output.metrics or {})}
        metrics = types_pb2.TrainMetrics(
            loss=float(trainer_metrics.get("loss:sum", math.nan)),
            mean_reward=batch.mean_reward,
            trained_tokens=batch.trained_tokens,
            total_tokens=batch.total_tokens,
            trajectories_used=batch.used,
            dropped_stale=batch.dropped_stale,
            dropped_zero_variance=batch.dropped_zero_variance,
            zero_variance_groups=batch.zero_variance_groups,
            staleness_histogram=batch.staleness_histogram,
            step_seconds=step_seconds,
            tokens_per_second=batch.total_tokens / step_seconds if step_seconds > 0 else 0.0,
            extra={**{k: float(v) for k, v in trainer_metrics.items()}, **batch.env_metrics},
        )
        now = time.time()
        sampler_row = CheckpointRow(
            name, KIND_SAMPLER, sampler_name(version), version, sampler_path, now, True
        )
        state_row = (
            CheckpointRow(name, KIND_STATE, state_name(version), version, state_path, now, True)
            if state_path is not None
            else None
        )
        response = pb.TrainResponse(
            policy_version=version,
            metrics=metrics,
            sampler_checkpoint=_checkpoint_info(sampler_row),
            state_checkpoint=_checkpoint_info(state_row) if state_row is not None else None,
        )
        # A state checkpoint of this name from an abandoned timeline (before a restore) is replaced.
        replaced = self._store.get_checkpoint(name, KIND_STATE, state_name(version)) if state_row else None
        self._crash_point("before_commit")
        with self._store.transaction() as tx:
            self._store.set_version(
                tx, name, version, (version, state_path) if state_path is not None else None
            )
            self._store.put_checkpoint(tx, sampler_row)
            if state_row is not None:
                self._store.put_checkpoint(tx, state_row)
            self._store.put_metrics(tx, name, version, metrics.SerializeToString())
            if request.idempotency_key:
                self._store.put_idempotency(
                    tx,
                    name,
                    request.idempotency_key,
                    _request_hash(request),
                    version,
                    response.SerializeToString(),
                )
            self._store.set_run_id(name, str(client.model_id), tx)
        if replaced is not None and replaced.tinker_path != state_path:
            await self._delete_tinker_paths([replaced.tinker_path])
        log.info(
            "model %s: version %d (loss %.4f, %d datums, %.3fs)",
            name,
            version,
            metrics.loss,
            len(batch.datums),
            step_seconds,
        )
        return response

    # ---- checkpoints

    @rpc
    async def SaveCheckpoint(
        self,
        request: pb.SaveCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.SaveCheckpointRequest, pb.SaveCheckpointResponse],
    ) -> pb.SaveCheckpointResponse:
        runtime = self._runtime(request.model)
        if request.name:
            v = Violations()
            check_name(v, "name", request.name)
            v.raise_if_any()
        async with runtime.lock:
            if runtime.dirty:
                await self._roll_back_to_recovery_point(request.model, runtime)
            row = self._model(request.model)
            name = request.name or state_name(row.policy_version)
            existing = self._store.get_checkpoint(row.name, KIND_STATE, name)
            if existing is not None:
                # The default name at the current version already holds exactly this state.
                if not request.name and existing.policy_version == row.policy_version:
                    return pb.SaveCheckpointResponse(checkpoint=_checkpoint_info(existing))
                raise errors.already_exists(
                    CHECKPOINT_RESOURCE,
                    f"{row.name}/{name}",
                    f"model {row.name!r} already has checkpoint {name!r}",
                )
            client = await self._training_client(row.name, runtime)
            path = (await client.save_state(name)).path
            checkpoint = CheckpointRow(
                row.name, KIND_STATE, name, row.policy_version, path, time.time(), False
            )
            with self._store.transaction() as tx:
                self._store.put_checkpoint(tx, checkpoint)
                self._store.set_version(tx, row.name, row.policy_version, (row.policy_version, path))
            return pb.SaveCheckpointResponse(checkpoint=_checkpoint_info(checkpoint))

    @rpc
    async def ListCheckpoints(
        self,
        request: pb.ListCheckpointsRequest,
        context: grpc.aio.ServicerContext[pb.ListCheckpointsRequest, pb.ListCheckpointsResponse],
    ) -> pb.ListCheckpointsResponse:
        self._model(request.model)
        return pb.ListCheckpointsResponse(
            checkpoints=[_checkpoint_info(row) for row in self._store.list_checkpoints(request.model)]
        )

    @rpc
    async def RestoreCheckpoint(
        self,
        request: pb.RestoreCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.RestoreCheckpointRequest, pb.RestoreCheckpointResponse],
    ) -> pb.RestoreCheckpointResponse:
        runtime = self._runtime(request.model)
        async with runtime.lock:
            self._model(request.model)
            checkpoint = self._store.get_checkpoint(request.model, KIND_STATE, request.checkpoint)
            if checkpoint is None:
                raise errors.not_found(
                    CHECKPOINT_RESOURCE,
                    f"{request.model}/{request.checkpoint}",
                    f"model {request.model!r} has no state checkpoint {request.checkpoint!r}",
                )
            version = checkpoint.policy_version
            runtime.dirty = True
            client = await self._backend.service.create_training_client_from_state_with_optimizer(
                checkpoint.tinker_path
            )
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
            runtime.training_client = client
            runtime.dirty = False
        await self._delete_tinker_paths([*stale_paths, *([old_sampler] if old_sampler else [])])
        log.info("model %s restored to %s (version %d)", request.model, request.checkpoint, version)
        return pb.RestoreCheckpointResponse(model=self._model_info(self._model(request.model)))

    @rpc
    async def DeleteCheckpoint(
        self,
        request: pb.DeleteCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.DeleteCheckpointRequest, pb.DeleteCheckpointResponse],
    ) -> pb.DeleteCheckpointResponse:
        runtime = self._runtime(request.model)
        kind = request.kind or types_pb2.CHECKPOINT_KIND_STATE  # == KIND_STATE, typed as the proto enum
        if kind not in (KIND_STATE, KIND_SAMPLER):
            raise errors.invalid_argument([("kind", f"unknown checkpoint kind {request.kind}")])
        async with runtime.lock:
            row = self._model(request.model)
            checkpoint = self._store.get_checkpoint(request.model, kind, request.checkpoint)
            if checkpoint is None:
                raise errors.not_found(
                    CHECKPOINT_RESOURCE,
                    f"{request.model}/{request.checkpoint}",
                    f"model {request.model!r} has no {types_pb2.CheckpointKind.Name(kind)} checkpoint "
                    f"{request.checkpoint!r}",
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
        await self._delete_tinker_paths([checkpoint.tinker_path])
        return pb.DeleteCheckpointResponse()

    # ---- export

    async def ExportWeights(
        self,
        request: pb.ExportWeightsRequest,
        context: grpc.aio.ServicerContext[pb.ExportWeightsRequest, pb.ExportWeightsResponse],
    ) -> AsyncIterator[pb.ExportWeightsResponse]:
        export = await self._fetch_export(request, context)
        with export.directory as directory:
            yield pb.ExportWeightsResponse(weights=export.weights)
            for file in export.weights.files:
                with open(Path(directory) / file.path, "rb") as handle:
                    offset = 0
                    while data := handle.read(EXPORT_CHUNK_BYTES):
                        yield pb.ExportWeightsResponse(
                            chunk=types_pb2.FileChunk(path=file.path, offset=offset, data=data)
                        )
                        offset += len(data)

    @rpc
    async def _fetch_export(
        self,
        request: pb.ExportWeightsRequest,
        context: grpc.aio.ServicerContext[pb.ExportWeightsRequest, pb.ExportWeightsResponse],
    ) -> _Export:
        """Saves the adapter in the backend's external format, downloads its files from the backend's
        (signed) URLs into a local temporary directory, and deletes the backend's copy."""
        runtime = self._runtime(request.model)
        v = Violations()
        for field_name in ("expected_policy_version", "policy_version"):
            if request.HasField(field_name) and getattr(request, field_name) < 0:
                v.add(field_name, "must be >= 0")
        v.raise_if_any()
        async with runtime.lock:
            row = self._model(request.model)
            _check_expected_version(row, request)
            version = request.policy_version if request.HasField("policy_version") else row.policy_version
            client = await self._training_client(row.name, runtime)
            name = f"export-{version:06d}-{uuid.uuid4().hex[:8]}"
            if version == row.policy_version:
                path = (await client.save_weights_external(name)).path
            else:
                path = await self._export_earlier_version(row, runtime, client, version, name)
        directory = tempfile.TemporaryDirectory(prefix="tinkerrpc-export-")
        try:
            urls = (await self._backend.rest.get_external_weights_urls(path)).urls
            async with httpx.AsyncClient(timeout=EXPORT_DOWNLOAD_TIMEOUT_SECONDS) as http:
                files = [
                    types_pb2.ExportedFile(
                        path=relative, size_bytes=await _download(http, url, Path(directory.name), relative)
                    )
                    for relative, url in sorted(urls.items())
                ]
        except BaseException:
            directory.cleanup()
            raise
        finally:
            await self._discard_backend_export(path)
        log.info("model %s: exported version %d (%d files)", row.name, version, len(files))
        weights = types_pb2.ExportedWeights(
            model=row.name, policy_version=version, base_model=row.base_model, files=files
        )
        return _Export(weights, directory)

    async def _export_earlier_version(
        self, row: ModelRow, runtime: ModelRuntime, client: tinker.TrainingClient, version: int, name: str
    ) -> str:
        """Export `version` < the current one without moving the model: load that version's state into
        the training client, export, then load the current state (weights and optimizer) back."""
        resource = f"{row.name}@{version}"
        if version > row.policy_version:
            raise errors.not_found(
                VERSION_RESOURCE, resource, f"model {row.name!r} is at version {row.policy_version}"
            )
        state = next(
            (
                c
                for c in self._store.list_checkpoints(row.name)
                if c.kind == KIND_STATE and c.policy_version == version
            ),
            None,
        )
        if state is None:
            raise errors.not_found(
                VERSION_RESOURCE,
                resource,
                f"model {row.name!r} has no state checkpoint at version {version} to export it from",
            )
        if row.recovery_version != row.policy_version:
            # Coming back needs the current version's full state, which --checkpoint-every > 1 may not keep.
            raise errors.failed_precondition(
                errors.NO_CURRENT_STATE,
                f"model {row.name!r} has no state checkpoint at its current version {row.policy_version}; "
                "SaveCheckpoint first, then export earlier versions",
                {"current_version": row.policy_version, "recovery_version": row.recovery_version},
            )
        try:
            await client.load_state(state.tinker_path)
            saved: tinker.types.SaveWeightsExternalResponse = await client.save_weights_external(name)
            return saved.path
        finally:
            try:
                await client.load_state_with_optimizer(row.recovery_path)
            except BaseException:
                runtime.dirty = True  # the next call rolls back to the recovery point: the current state
                raise

    async def _discard_backend_export(self, path: str) -> None:
        try:
            await self._backend.rest.delete_checkpoint_from_tinker_path(path)
        except Exception as err:  # a stray backend copy only costs space: never fail the export for it
            log.warning("could not delete the backend's export %s: %s", path, err)

    # ---- sample

    @rpc
    async def Sample(
        self,
        request: pb.SampleRequest,
        context: grpc.aio.ServicerContext[pb.SampleRequest, pb.SampleResponse],
    ) -> pb.SampleResponse:
        row = self._model(request.model)
        version = request.policy_version if request.HasField("policy_version") else row.policy_version
        path = self._store.sampler_path(row.name, version)
        if path is None:
            raise errors.not_found(
                VERSION_RESOURCE,
                f"{row.name}@{version}",
                f"model {row.name!r} has no sampleable version {version} "
                f"(sampleable: {self._store.sampleable_versions(row.name)})",
            )
        codec = await self._codec(row)
        prompt = self._sample_prompt(request, codec)
        params = request.params
        sampling_params = self._sampling_params(params, len(prompt), codec)
        client = await self._sampling_client(path)
        result = await client.sample(
            tinker.types.ModelInput.from_ints(prompt),
            num_samples=params.n or 1,
            sampling_params=sampling_params,
            include_prompt_logprobs=params.include_prompt_logprobs,
        )
        sequences = [
            self._sampled_sequence(seq.tokens, seq.logprobs or [], seq.stop_reason, request, version, codec)
            for seq in result.sequences
        ]
        if params.top_logprobs > 0:
            await asyncio.gather(
                *(self._fill_top_logprobs(client, prompt, seq, params, codec) for seq in sequences)
            )
        response = pb.SampleResponse(
            sequences=sequences, prompt_token_ids=prompt, policy_version=version, model=row.name
        )
        if params.include_prompt_logprobs:
            response.prompt_logprobs.extend(
                math.nan if lp is None else lp for lp in (result.prompt_logprobs or [None] * len(prompt))
            )
        return response

    def _sample_prompt(self, request: pb.SampleRequest, codec: ChatCodec) -> list[int]:
        v = Violations()
        kind = request.WhichOneof("prompt")
        prompt: list[int] = []
        if kind == "chat":
            if not request.chat.messages:
                v.add("chat.messages", "give at least one message")
            for field_name, description in check_messages(list(request.chat.messages), "chat.messages"):
                v.add(field_name, description)
            for field_name, description in check_tools(list(request.chat.tools), "chat.tools"):
                v.add(field_name, description)
            v.raise_if_any()
            messages = codec.with_tools(
                to_cookbook_messages(list(request.chat.messages)), list(request.chat.tools)
            )
            prompt = list(codec.renderer.build_generation_prompt(messages).to_ints())
        elif kind == "tokens":
            prompt = list(request.tokens.token_ids)
            bad = next((i for i, t in enumerate(prompt) if not 0 <= t < codec.vocab_size), None)
            if bad is not None:
                v.add(
                    "tokens.token_ids",
                    f"token id {prompt[bad]} at index {bad} is outside the vocabulary [0, {codec.vocab_size})",
                )
        elif kind == "text":
            prompt = list(codec.tokenizer.encode(request.text, add_special_tokens=False))
        else:
            v.add("prompt", "give chat, tokens or text")
        if kind is not None and not prompt:
            v.add(kind, "the prompt is empty")
        v.raise_if_any()
        return prompt

    def _sampling_params(
        self, params: types_pb2.SamplingParams, prompt_length: int, codec: ChatCodec
    ) -> tinker.types.SamplingParams:
        v = Violations()
        limits = self._limits
        if params.n < 0:
            v.add("params.n", "must be >= 1 (0 = default 1)")
        elif params.n > limits.max_sample_n:
            v.add(
                "params.n",
                f"{params.n} is over this server's limit of {limits.max_sample_n} (--max-sample-n)",
            )
        if prompt_length >= codec.max_context_length:
            v.add("prompt", f"{prompt_length} tokens fill the model's context of {codec.max_context_length}")
        if params.max_tokens <= 0:
            v.add("params.max_tokens", "must be > 0 (it is required)")
        elif params.max_tokens > limits.max_sample_tokens:
            v.add(
                "params.max_tokens",
                f"{params.max_tokens} is over this server's limit of {limits.max_sample_tokens} "
                "(--max-sample-tokens)",
            )
        elif prompt_length + params.max_tokens > codec.max_context_length:
            v.add(
                "params.max_tokens",
                f"prompt ({prompt_length}) + max_tokens ({params.max_tokens}) exceed the context of "
                f"{codec.max_context_length}",
            )
        if params.HasField("temperature") and not (
            math.isfinite(params.temperature) and params.temperature >= 0
        ):
            v.add("params.temperature", "must be >= 0")
        if params.HasField("top_p") and not 0 < params.top_p <= 1:
            v.add("params.top_p", "must be in (0, 1]")
        if params.top_k < 0:
            v.add("params.top_k", "must be >= 0 (0 = off)")
        if params.top_logprobs < 0:
            v.add("params.top_logprobs", "must be >= 0")
        bad = [t for t in params.stop_token_ids if not 0 <= t < codec.vocab_size]
        if bad:
            v.add(
                "params.stop_token_ids", f"token ids {bad} are outside the vocabulary [0, {codec.vocab_size})"
            )
        if any(not s for s in params.stop):
            v.add("params.stop", "stop strings must not be empty")
        v.raise_if_any()
        stop_tokens = list(params.stop_token_ids)
        if not params.ignore_default_stops:
            stop_tokens += [t for t in codec.default_stop_tokens() if t not in stop_tokens]
        # Tinker takes either stop strings or stop token ids: with both, tokens become their texts.
        stop: list[str] | list[int] = (
            [*params.stop, *(codec.token_text(t) for t in stop_tokens)] if params.stop else stop_tokens
        )
        return tinker.types.SamplingParams(
            max_tokens=params.max_tokens,
            seed=params.seed if params.HasField("seed") else None,
            stop=stop,
            temperature=params.temperature if params.HasField("temperature") else 1.0,
            top_k=params.top_k or -1,
            top_p=params.top_p if params.HasField("top_p") else 1.0,
        )

    def _sampled_sequence(
        self,
        tokens: list[int],
        logprobs: list[float],
        stop_reason: str,
        request: pb.SampleRequest,
        version: int,
        codec: ChatCodec,
    ) -> types_pb2.SampledSequence:
        sequence = types_pb2.SampledSequence(
            token_ids=tokens,
            logprobs=logprobs,
            text=codec.decode(tokens),
            stop_reason=types_pb2.STOP_REASON_LENGTH
            if stop_reason == "length"
            else types_pb2.STOP_REASON_STOP,
            policy_version=version,
        )
        if request.WhichOneof("prompt") == "chat":
            message, _termination = codec.renderer.parse_response(tokens)
            sequence.message.CopyFrom(to_proto_message(message))
        if request.params.return_token_texts:
            sequence.token_texts.extend(codec.token_text(t) for t in tokens)
        return sequence

    async def _fill_top_logprobs(
        self,
        client: tinker.SamplingClient,
        prompt: list[int],
        sequence: types_pb2.SampledSequence,
        params: types_pb2.SamplingParams,
        codec: ChatCodec,
    ) -> None:
        """Top-k alternatives at each sampled position, from a prompt-logprobs pass over prompt + completion
        (a plain SDK call, so it works on Tinker itself too)."""
        tokens = list(sequence.token_ids)
        if not tokens:
            return
        scored = await client.sample(
            tinker.types.ModelInput.from_ints(prompt + tokens),
            num_samples=1,
            sampling_params=tinker.types.SamplingParams(max_tokens=1),
            include_prompt_logprobs=True,
            topk_prompt_logprobs=params.top_logprobs,
        )
        rows = scored.topk_prompt_logprobs or []
        for position in range(len(prompt), len(prompt) + len(tokens)):
            alternatives = rows[position] if position < len(rows) and rows[position] else []
            top = sequence.top_logprobs.add(
                token_ids=[t for t, _ in alternatives], logprobs=[lp for _, lp in alternatives]
            )
            if params.return_token_texts:
                top.token_texts.extend(codec.token_text(t) for t, _ in alternatives)
