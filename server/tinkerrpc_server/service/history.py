"""GetRunHistory and WatchModel: a model's run read back from the metrics row each Train step commits
(store.step_metrics) with the checkpoints of each version that remain, and its live events (events.py)."""

from __future__ import annotations

import asyncio
from collections import defaultdict
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass

import grpc

from tinkerrpc.contract.limits import DEFAULT_HISTORY_PAGE_SIZE, MAX_WATCH_BACKLOG_EVENTS
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.events import Subscription
from tinkerrpc_server.service.models import MODEL_RESOURCE, ModelRegistry, checkpoint_info, timestamp
from tinkerrpc_server.service.store import MetricsRow, Store
from tinkerrpc_server.service.validation import check_history_request, check_watch_request

# How often an idle watch checks that its model still exists (DeleteModel ends the stream NOT_FOUND).
MODEL_CHECK_SECONDS = 2.0
ALL_VERSIONS = 2**62


class History:
    def __init__(self, store: Store, models: ModelRegistry) -> None:
        self._store = store
        self._models = models

    def page(self, request: pb.GetRunHistoryRequest) -> pb.GetRunHistoryResponse:
        first = check_history_request(request)
        self._models.row(request.model)
        size = request.page_size or DEFAULT_HISTORY_PAGE_SIZE
        last = request.to_version if request.HasField("to_version") else None
        # One row beyond the page tells whether another page follows.
        rows = self._store.metrics_rows(request.model, first, last, size + 1)
        steps = self._steps(request.model, rows[:size])
        more = len(rows) > size
        return pb.GetRunHistoryResponse(
            steps=steps, next_page_token=str(steps[-1].policy_version + 1) if more else ""
        )

    def watch(self, request: pb.WatchModelRequest) -> Watch:
        """Subscribes, then reads the replay, with no await in between (see events.py)."""
        check_watch_request(request)
        self._models.row(request.model)
        subscription = self._models.events.subscribe(request.model)
        replay = (
            self._steps(
                request.model,
                self._store.metrics_rows(request.model, request.from_version, None, ALL_VERSIONS),
            )
            if request.HasField("from_version")
            else []
        )
        return Watch(self._store, self._models, request.model, subscription, replay)

    def _steps(self, model: str, rows: Sequence[MetricsRow]) -> list[types_pb2.RunStep]:
        if not rows:
            return []
        first, last = rows[0].policy_version, rows[-1].policy_version
        checkpoints: defaultdict[int, list[types_pb2.CheckpointInfo]] = defaultdict(list)
        for checkpoint in self._store.list_checkpoints(model):
            if first <= checkpoint.policy_version <= last:
                checkpoints[checkpoint.policy_version].append(checkpoint_info(checkpoint))
        return [
            types_pb2.RunStep(
                policy_version=row.policy_version,
                metrics=types_pb2.TrainMetrics.FromString(row.metrics),
                commit_time=timestamp(row.create_time),
                checkpoints=checkpoints[row.policy_version],
            )
            for row in rows
        ]


@dataclass
class Watch:
    """One WatchModel stream: its replayed steps, then its subscription's events."""

    store: Store
    models: ModelRegistry
    model: str
    subscription: Subscription
    replay: list[types_pb2.RunStep]

    async def responses(
        self, context: grpc.aio.ServicerContext[pb.WatchModelRequest, pb.WatchModelResponse]
    ) -> AsyncIterator[pb.WatchModelResponse]:
        try:
            for step in self.replay:
                yield pb.WatchModelResponse(
                    version=step,
                    policy_version=step.policy_version,
                    event_time=step.commit_time,
                    replayed=True,
                )
            while True:
                ended = await self._wait()
                if ended is not None:
                    # grpc-stubs' aio.ServicerContext lacks abort_with_status (grpc.aio has it since 1.38).
                    await context.abort_with_status(ended.to_status())  # type: ignore[attr-defined]
                while self.subscription.pending:
                    yield self.subscription.pending.popleft()
        finally:
            self.models.events.unsubscribe(self.model, self.subscription)

    async def _wait(self) -> errors.ServiceError | None:
        """Until events are pending; the error that ends the stream instead, if any."""
        while True:
            try:
                await asyncio.wait_for(self.subscription.ready.wait(), MODEL_CHECK_SECONDS)
            except TimeoutError:
                if self.store.get_model(self.model) is None:
                    return errors.not_found(
                        MODEL_RESOURCE, self.model, f"model {errors.shown(self.model)} was deleted"
                    )
                continue
            self.subscription.ready.clear()
            if self.subscription.overflowed:
                return errors.ServiceError(
                    grpc.StatusCode.ABORTED,
                    f"this watcher fell more than {MAX_WATCH_BACKLOG_EVENTS} events behind; watch again "
                    "with from_version = the last version it saw + 1",
                )
            return None
