"""Each model's live events for WatchModel: training.py and checkpoints.py publish here right after their
commit, with no await in between, and a watcher subscribes and reads its replay from the store with no
await in between either; as both run on the event loop, a watcher that replays the store and then follows
its subscription misses no committed version and sees none twice."""

from __future__ import annotations

import asyncio
import time
from collections import deque

from google.protobuf import timestamp_pb2

from tinkerrpc.contract.limits import MAX_WATCH_BACKLOG_EVENTS
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2


def now_timestamp() -> timestamp_pb2.Timestamp:
    stamp = timestamp_pb2.Timestamp()
    stamp.FromNanoseconds(time.time_ns())
    return stamp


class Subscription:
    """One watcher's pending events; `ready` is set when some arrived or the backlog overflowed."""

    def __init__(self) -> None:
        self.pending: deque[pb.WatchModelResponse] = deque()
        self.ready = asyncio.Event()
        self.overflowed = False

    def offer(self, event: pb.WatchModelResponse) -> None:
        if len(self.pending) >= MAX_WATCH_BACKLOG_EVENTS:
            self.overflowed = True
        elif not self.overflowed:
            self.pending.append(event)
        self.ready.set()


class ModelEvents:
    """The subscriptions of every model's watchers, and the events the service publishes to them."""

    def __init__(self) -> None:
        self._subscriptions: dict[str, set[Subscription]] = {}

    def subscribe(self, model: str) -> Subscription:
        subscription = Subscription()
        self._subscriptions.setdefault(model, set()).add(subscription)
        return subscription

    def unsubscribe(self, model: str, subscription: Subscription) -> None:
        watchers = self._subscriptions.get(model)
        if watchers is not None:
            watchers.discard(subscription)
            if not watchers:
                del self._subscriptions[model]

    def _publish(self, model: str, event: pb.WatchModelResponse) -> None:
        for subscription in self._subscriptions.get(model, ()):
            subscription.offer(event)

    def train_committed(self, model: str, response: pb.TrainResponse) -> None:
        """A Train step committed the version `response` reports."""
        committed = now_timestamp()
        checkpoints = [response.sampler_checkpoint]
        if response.HasField("state_checkpoint"):
            checkpoints.append(response.state_checkpoint)
        step = types_pb2.RunStep(
            policy_version=response.policy_version,
            metrics=response.metrics,
            commit_time=committed,
            checkpoints=checkpoints,
        )
        self._publish(
            model,
            pb.WatchModelResponse(version=step, policy_version=response.policy_version, event_time=committed),
        )

    def checkpoint_saved(self, checkpoint: types_pb2.CheckpointInfo, model_version: int) -> None:
        self._publish(
            checkpoint.model,
            pb.WatchModelResponse(
                checkpoint_saved=checkpoint, policy_version=model_version, event_time=now_timestamp()
            ),
        )

    def checkpoint_deleted(self, checkpoint: types_pb2.CheckpointInfo, model_version: int) -> None:
        self._publish(
            checkpoint.model,
            pb.WatchModelResponse(
                checkpoint_deleted=checkpoint, policy_version=model_version, event_time=now_timestamp()
            ),
        )

    def restored(self, checkpoint: types_pb2.CheckpointInfo) -> None:
        self._publish(
            checkpoint.model,
            pb.WatchModelResponse(
                restored=types_pb2.ModelRestored(checkpoint=checkpoint),
                policy_version=checkpoint.policy_version,
                event_time=now_timestamp(),
            ),
        )
