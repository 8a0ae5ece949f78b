"""tinkerrpc.v1.TrainerService over the tinker SDK: one method per RPC, each delegating to the room that
owns its state.

State lives in SQLite (store.py); the Tinker backend (Tinker itself or the embedded engine) holds the
weights. models.py keeps each model's runtime and clients and rebuilds a training client at the committed
version; training.py is the Train transaction; recovery.py holds the write-ahead step records and their
replay; checkpoints.py, sampling.py and exporting.py serve the other RPCs; validation.py holds every
request check; calls.py maps errors to statuses and supervises the embedded engine.

Restart recovery loses no committed version at any --checkpoint-every K: a model's training client is
loaded on first use from its recovery point (the last committed state checkpoint, up to K-1 versions
behind) and the steps recorded after it are replayed, so version, weights and optimizer state agree.
Only steps that never committed are gone (their orphan checkpoints are deleted at start).

Engine supervision (embedded engine only): when the engine child exits, calls in flight fail UNAVAILABLE,
new calls wait (within their deadline) while a new engine starts on a fresh port; every model's training
client is then rebuilt the same way on next use; sampling clients are made anew from the same tinker://
paths, as the engine's data dir persists.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from importlib import metadata
from typing import cast

import grpc

from tinkerrpc.contract.limits import (
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
)
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.calls import EngineSupervisor, rpc
from tinkerrpc_server.service.checkpoints import Checkpoints
from tinkerrpc_server.service.exporting import Export, Exporter
from tinkerrpc_server.service.history import History, Watch
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.models import ModelRegistry
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.sample_cache import SampleCache
from tinkerrpc_server.service.sample_stream import SampleStreamer
from tinkerrpc_server.service.sampling import Sampler
from tinkerrpc_server.service.store import Store
from tinkerrpc_server.service.training import StepHooks, Trainer
from tinkerrpc_server.service.validation import check_create_model

# Responses of a SampleStream made ahead of its reader.
STREAM_QUEUE_RESPONSES = 64


@dataclass(frozen=True)
class _StreamOrder:
    """A SampleStream's request and where its responses go."""

    request: pb.SampleStreamRequest
    made: asyncio.Queue[pb.SampleStreamResponse | None]


@dataclass(frozen=True)
class Hosting:
    """What the server process, not the service, decides and GetServerInfo reports."""

    max_message_bytes: int
    # The URL the hosted sidecar listens on (serve --sidecar-port), e.g. "http://127.0.0.1:8000/v1".
    sidecar_url: str | None = None
    sidecar_requires_api_key: bool = False


class TrainerService(trainer_service_pb2_grpc.TrainerServiceServicer):
    def __init__(
        self,
        store: Store,
        backend: Backend,
        codecs: ChatCodecs,
        checkpoint_every: int,
        limits: Limits,
        step_hooks: StepHooks,
        hosting: Hosting,
    ) -> None:
        self._server_info = _server_info(backend, limits, hosting)
        sample_cache = SampleCache(store.sampler_path)
        self._models = ModelRegistry(store, backend, codecs, limits, sample_cache)
        self._supervisor = EngineSupervisor(backend, self._models, limits.backend_timeout)
        self._trainer = Trainer(store, self._models, checkpoint_every, limits, step_hooks, sample_cache)
        self._checkpoints = Checkpoints(store, backend, self._models)
        self._sampler = Sampler(store, self._models, limits, sample_cache, backend)
        self._streamer = SampleStreamer(self._sampler, backend)
        self._exporter = Exporter(store, backend, self._models)
        self._history = History(store, self._models)

    @property
    def supervisor(self) -> EngineSupervisor:
        return self._supervisor

    async def recover(self) -> None:
        await self._models.recover()

    async def finish_tidying(self) -> None:
        """The backend work left after the last commits (pruned files, checkpoint sizes): before stopping."""
        await self._models.tidy_all()

    @property
    def supervises_engine(self) -> bool:
        return self._supervisor.supervises_engine

    async def supervise_engine(self, report_serving: Callable[[bool], Awaitable[None]]) -> None:
        await self._supervisor.supervise(report_serving)

    async def watch_session(self, report_serving: Callable[[bool], Awaitable[None]]) -> None:
        await self._supervisor.watch_session(report_serving)

    # ---- models

    @rpc
    async def CreateModel(
        self,
        request: pb.CreateModelRequest,
        context: grpc.aio.ServicerContext[pb.CreateModelRequest, pb.CreateModelResponse],
    ) -> pb.CreateModelResponse:
        check_create_model(request)
        return pb.CreateModelResponse(model=await self._models.create(request))

    @rpc
    async def GetModel(
        self,
        request: pb.GetModelRequest,
        context: grpc.aio.ServicerContext[pb.GetModelRequest, pb.GetModelResponse],
    ) -> pb.GetModelResponse:
        await self._models.tidied(request.name)  # its checkpoint_bytes counts the last step's files
        return pb.GetModelResponse(model=self._models.info(self._models.row(request.name)))

    @rpc
    async def ListModels(
        self,
        request: pb.ListModelsRequest,
        context: grpc.aio.ServicerContext[pb.ListModelsRequest, pb.ListModelsResponse],
    ) -> pb.ListModelsResponse:
        await self._models.tidy_all()
        return pb.ListModelsResponse(models=self._models.infos())

    @rpc
    async def DeleteModel(
        self,
        request: pb.DeleteModelRequest,
        context: grpc.aio.ServicerContext[pb.DeleteModelRequest, pb.DeleteModelResponse],
    ) -> pb.DeleteModelResponse:
        await self._models.delete(request.name)
        return pb.DeleteModelResponse()

    # ---- train

    @rpc
    async def Train(
        self, request: pb.TrainRequest, context: grpc.aio.ServicerContext[pb.TrainRequest, pb.TrainResponse]
    ) -> pb.TrainResponse:
        return await self._trainer.train(request)

    # ---- checkpoints

    @rpc
    async def SaveCheckpoint(
        self,
        request: pb.SaveCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.SaveCheckpointRequest, pb.SaveCheckpointResponse],
    ) -> pb.SaveCheckpointResponse:
        return pb.SaveCheckpointResponse(checkpoint=await self._checkpoints.save(request))

    @rpc
    async def ListCheckpoints(
        self,
        request: pb.ListCheckpointsRequest,
        context: grpc.aio.ServicerContext[pb.ListCheckpointsRequest, pb.ListCheckpointsResponse],
    ) -> pb.ListCheckpointsResponse:
        return pb.ListCheckpointsResponse(checkpoints=self._checkpoints.infos(request.model))

    @rpc
    async def RestoreCheckpoint(
        self,
        request: pb.RestoreCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.RestoreCheckpointRequest, pb.RestoreCheckpointResponse],
    ) -> pb.RestoreCheckpointResponse:
        return pb.RestoreCheckpointResponse(model=await self._checkpoints.restore(request))

    @rpc
    async def DeleteCheckpoint(
        self,
        request: pb.DeleteCheckpointRequest,
        context: grpc.aio.ServicerContext[pb.DeleteCheckpointRequest, pb.DeleteCheckpointResponse],
    ) -> pb.DeleteCheckpointResponse:
        await self._checkpoints.delete(request)
        return pb.DeleteCheckpointResponse()

    # ---- sample

    @rpc
    async def Sample(
        self,
        request: pb.SampleRequest,
        context: grpc.aio.ServicerContext[pb.SampleRequest, pb.SampleResponse],
    ) -> pb.SampleResponse:
        return await self._sampler.sample(request)

    async def SampleStream(
        self,
        request: pb.SampleStreamRequest,
        context: grpc.aio.ServicerContext[pb.SampleStreamRequest, pb.SampleStreamResponse],
    ) -> AsyncIterator[pb.SampleStreamResponse]:
        # Made under `rpc` (statuses, deadline, engine supervision) on a task of its own, handed over
        # through a small queue: a slow reader slows the sampling's stream down instead of piling it up.
        made: asyncio.Queue[pb.SampleStreamResponse | None] = asyncio.Queue(STREAM_QUEUE_RESPONSES)
        # `rpc` reads only the context's deadline and aborts it, whatever the request's type.
        order_context = cast("grpc.aio.ServicerContext[_StreamOrder, pb.SampleStreamResponse]", context)
        producer = asyncio.ensure_future(self._make_stream(_StreamOrder(request, made), order_context))
        try:
            while True:
                taken = asyncio.ensure_future(made.get())
                await asyncio.wait({taken, producer}, return_when=asyncio.FIRST_COMPLETED)
                if not taken.done():
                    taken.cancel()
                    producer.result()  # it ended without its end marker: its status
                    return
                response = taken.result()
                if response is None:
                    return
                yield response
        finally:
            producer.cancel()

    @rpc
    async def _make_stream(
        self,
        order: _StreamOrder,
        context: grpc.aio.ServicerContext[_StreamOrder, pb.SampleStreamResponse],
    ) -> None:
        async for response in self._streamer.stream(order.request):
            await order.made.put(response)
        await order.made.put(None)

    # ---- the server

    async def GetServerInfo(
        self,
        request: pb.GetServerInfoRequest,
        context: grpc.aio.ServicerContext[pb.GetServerInfoRequest, pb.GetServerInfoResponse],
    ) -> pb.GetServerInfoResponse:
        # Fixed at start and needs no backend: answered even while the engine restarts.
        return self._server_info

    # ---- export

    async def ExportWeights(
        self,
        request: pb.ExportWeightsRequest,
        context: grpc.aio.ServicerContext[pb.ExportWeightsRequest, pb.ExportWeightsResponse],
    ) -> AsyncIterator[pb.ExportWeightsResponse]:
        export = await self._fetch_export(request, context)
        with export.directory:
            for response in export.responses():
                yield response

    @rpc
    async def _fetch_export(
        self,
        request: pb.ExportWeightsRequest,
        context: grpc.aio.ServicerContext[pb.ExportWeightsRequest, pb.ExportWeightsResponse],
    ) -> Export:
        """ExportWeights' preparation, under `rpc`: the files are local before the stream starts."""
        return await self._exporter.fetch(request)

    # ---- run history

    @rpc
    async def GetRunHistory(
        self,
        request: pb.GetRunHistoryRequest,
        context: grpc.aio.ServicerContext[pb.GetRunHistoryRequest, pb.GetRunHistoryResponse],
    ) -> pb.GetRunHistoryResponse:
        return self._history.page(request)

    async def WatchModel(
        self,
        request: pb.WatchModelRequest,
        context: grpc.aio.ServicerContext[pb.WatchModelRequest, pb.WatchModelResponse],
    ) -> AsyncIterator[pb.WatchModelResponse]:
        watch = await self._start_watch(request, context)
        async for response in watch.responses(context):
            yield response

    @rpc
    async def _start_watch(
        self,
        request: pb.WatchModelRequest,
        context: grpc.aio.ServicerContext[pb.WatchModelRequest, pb.WatchModelResponse],
    ) -> Watch:
        """WatchModel's start, under `rpc`: checks, the subscription and the replay's read."""
        return self._history.watch(request)


def _server_info(backend: Backend, limits: Limits, hosting: Hosting) -> pb.GetServerInfoResponse:
    return pb.GetServerInfoResponse(
        server_version=metadata.version("tinkerrpc"),
        backend=pb.BACKEND_KIND_EMBEDDED_ENGINE if backend.embedded else pb.BACKEND_KIND_TINKER,
        sidecar_url=hosting.sidecar_url or "",
        sidecar_requires_api_key=hosting.sidecar_requires_api_key,
        limits=pb.ServerLimits(
            max_sample_n=limits.max_sample_n,
            max_sample_tokens=limits.max_sample_tokens,
            max_train_trajectories=limits.max_train_trajectories,
            max_train_tokens=limits.max_train_tokens,
            max_message_bytes=hosting.max_message_bytes,
            max_top_logprobs=MAX_TOP_LOGPROBS,
            max_stop_strings=MAX_STOP_STRINGS,
            max_stop_string_bytes=MAX_STOP_STRING_BYTES,
            max_stop_token_ids=MAX_STOP_TOKEN_IDS,
            backend_timeout_seconds=limits.backend_timeout,
        ),
    )
