"""GetRunHistory and WatchModel on a real server: the metrics of every version read back in pages, and a
watch that replays the history from a version and then follows live Trains, checkpoints and restores
without a gap or a repeat; the SDK's history() and watch() (sync and async) over the same RPCs."""

from __future__ import annotations

import asyncio
import queue
import threading
from collections.abc import Iterator

import grpc
import pytest
from svc import CALL_TIMEOUT, Server, create_model, error_details, rl_request, sample_chat

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

MODEL = "history-model"
EVENT_TIMEOUT = 60.0


def _train(server: Server, model: str, seed: int, rewards: tuple[float, float] = (1.0, 0.0)) -> int:
    sample = sample_chat(server.stub, model, "respond with yes", n=2, max_tokens=3, seed=seed)
    request = rl_request(model, sample, list(rewards))
    return server.stub.Train(request, timeout=CALL_TIMEOUT).policy_version


class Watcher:
    """A WatchModel stream read on a thread, its events queued as they arrive."""

    def __init__(self, server: Server, request: pb.WatchModelRequest) -> None:
        self.stream = server.stub.WatchModel(request)
        self.events: queue.Queue[pb.WatchModelResponse | grpc.RpcError] = queue.Queue()
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()

    def _read(self) -> None:
        try:
            for event in self.stream:
                self.events.put(event)
        except grpc.RpcError as error:
            self.events.put(error)

    def next(self) -> pb.WatchModelResponse:
        """The next event, past deletions of automatic checkpoints (the retention policy's, which vary)."""
        while True:
            event = self.events.get(timeout=EVENT_TIMEOUT)
            assert isinstance(event, pb.WatchModelResponse), event
            if not (event.HasField("checkpoint_deleted") and event.checkpoint_deleted.automatic):
                return event

    def error(self) -> grpc.RpcError:
        event = self.events.get(timeout=EVENT_TIMEOUT)
        assert isinstance(event, grpc.RpcError), event
        return event

    def close(self) -> None:
        self.stream.cancel()
        self._thread.join(10)


@pytest.fixture(scope="module")
def trained(server: Server) -> Iterator[Server]:
    """MODEL at version 3, each step from rewards (1, 0): mean 0.5, population std 0.5; the named state
    checkpoint "two" holds version 2."""
    create_model(server.stub, MODEL)
    for seed in (1, 2, 3):
        _train(server, MODEL, seed)
        if seed == 2:
            server.stub.SaveCheckpoint(
                pb.SaveCheckpointRequest(model=MODEL, name="two"), timeout=CALL_TIMEOUT
            )
    yield server


def test_history_pages_hold_every_versions_metrics_and_checkpoints(trained: Server) -> None:
    stub = trained.stub
    first = stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL, page_size=2), timeout=CALL_TIMEOUT)
    assert [s.policy_version for s in first.steps] == [1, 2] and first.next_page_token
    second = stub.GetRunHistory(
        pb.GetRunHistoryRequest(model=MODEL, page_size=2, page_token=first.next_page_token),
        timeout=CALL_TIMEOUT,
    )
    assert [s.policy_version for s in second.steps] == [3] and second.next_page_token == ""
    whole = stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL), timeout=CALL_TIMEOUT)
    assert list(whole.steps) == [*first.steps, *second.steps]
    for step in whole.steps:
        metrics = step.metrics
        assert (metrics.mean_reward, metrics.std_reward, metrics.learning_rate) == pytest.approx(
            (0.5, 0.5, 1e-2)
        )
        assert metrics.trajectories_used == 2 and metrics.total_tokens > 0 and metrics.step_seconds > 0
        assert dict(metrics.staleness_histogram) == {0: 2} and metrics.loss == metrics.loss  # not NaN
        assert step.commit_time.seconds > 0
        names = {(c.name, c.kind) for c in step.checkpoints}
        assert (f"v{step.policy_version:06d}", types_pb2.CHECKPOINT_KIND_SAMPLER) in names
    assert ("two", types_pb2.CHECKPOINT_KIND_STATE) in {(c.name, c.kind) for c in whole.steps[1].checkpoints}
    # The latest version's state checkpoint is the recovery point, which retention always keeps.
    assert "step_000003" in {c.name for c in whole.steps[2].checkpoints}
    ranged = stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL, from_version=2, to_version=2))
    assert [s.policy_version for s in ranged.steps] == [2]
    assert stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL, from_version=9)).steps == []


@pytest.mark.parametrize(
    ("request_fields", "field"),
    [
        ({"page_size": 1001}, "page_size"),
        ({"page_size": -1}, "page_size"),
        ({"from_version": -1}, "from_version"),
        ({"from_version": 3, "to_version": 2}, "to_version"),
        ({"page_token": "next"}, "page_token"),
        ({"page_token": "9" * 40}, "page_token"),
        ({"from_version": 5, "page_token": "2"}, "page_token"),
    ],
)
def test_history_refuses_bad_requests_naming_the_field(
    trained: Server, request_fields: dict[str, object], field: str
) -> None:
    with pytest.raises(grpc.RpcError) as err:
        trained.stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL, **request_fields))  # type: ignore[arg-type]
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    violations = [v.field for d in error_details(err.value) for v in getattr(d, "field_violations", [])]
    assert violations == [field]


def test_unknown_models_are_not_found(trained: Server) -> None:
    with pytest.raises(grpc.RpcError) as err:
        trained.stub.GetRunHistory(pb.GetRunHistoryRequest(model="no-such-model"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    watcher = Watcher(trained, pb.WatchModelRequest(model="no-such-model"))
    assert watcher.error().code() == grpc.StatusCode.NOT_FOUND
    watcher = Watcher(trained, pb.WatchModelRequest(model=MODEL, from_version=-1))
    assert watcher.error().code() == grpc.StatusCode.INVALID_ARGUMENT


def test_watch_replays_from_a_version_then_follows_live_events(trained: Server) -> None:
    stub = trained.stub
    watcher = Watcher(trained, pb.WatchModelRequest(model=MODEL, from_version=2))
    try:
        replayed = [watcher.next(), watcher.next()]
        assert [(e.version.policy_version, e.replayed) for e in replayed] == [(2, True), (3, True)]
        history = stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL, from_version=2)).steps
        assert [e.version for e in replayed] == list(history)

        assert _train(trained, MODEL, 4, rewards=(2.0, 0.0)) == 4
        live = watcher.next()
        assert (live.WhichOneof("event"), live.policy_version, live.replayed) == ("version", 4, False)
        assert live.version.metrics.mean_reward == pytest.approx(1.0)
        assert live.version.metrics.std_reward == pytest.approx(1.0)
        assert {c.name for c in live.version.checkpoints} == {"v000004", "step_000004"}

        stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="kept"), timeout=CALL_TIMEOUT)
        saved = watcher.next()
        assert (saved.checkpoint_saved.name, saved.policy_version) == ("kept", 4)
        # The latest save is the recovery point, which cannot be deleted: save another before.
        stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="newer"), timeout=CALL_TIMEOUT)
        assert watcher.next().checkpoint_saved.name == "newer"
        stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(model=MODEL, checkpoint="kept"))
        deleted = watcher.next()
        assert (deleted.checkpoint_deleted.name, deleted.checkpoint_deleted.kind) == (
            "kept",
            types_pb2.CHECKPOINT_KIND_STATE,
        )
        stub.RestoreCheckpoint(
            pb.RestoreCheckpointRequest(model=MODEL, checkpoint="two"), timeout=CALL_TIMEOUT
        )
        restored = watcher.next()
        assert (restored.restored.checkpoint.name, restored.policy_version) == ("two", 2)
        # The restore undid versions 3 and 4: the history ends at 2, and the next step is 3 again.
        after = stub.GetRunHistory(pb.GetRunHistoryRequest(model=MODEL)).steps
        assert [s.policy_version for s in after] == [1, 2]
        assert _train(trained, MODEL, 5) == 3
        assert watcher.next().version.policy_version == 3
    finally:
        watcher.close()


def test_watch_of_a_deleted_model_ends_not_found(server: Server) -> None:
    create_model(server.stub, "history-doomed")
    _train(server, "history-doomed", seed=1)
    watcher = Watcher(server, pb.WatchModelRequest(model="history-doomed", from_version=0))
    # The replayed step comes after the subscription: the stream now follows the model live.
    assert watcher.next().replayed
    server.stub.DeleteModel(pb.DeleteModelRequest(name="history-doomed"), timeout=CALL_TIMEOUT)
    assert watcher.error().code() == grpc.StatusCode.NOT_FOUND


def test_sdk_history_and_watch_sync_and_async(server: Server) -> None:
    name = "history-sdk"
    create_model(server.stub, name)
    _train(server, name, 1)
    with tinkerrpc.Client(f"127.0.0.1:{server.port}") as client:
        model = client.model(name)
        page = model.history(page_size=1)
        assert [s.policy_version for s in page.steps] == [1] and page.next_page_token is None
        step = page.steps[0]
        assert isinstance(step, tinkerrpc.RunStep) and step.metrics.std_reward == pytest.approx(0.5)
        assert step.metrics.learning_rate == pytest.approx(1e-2) and step.commit_time is not None
        assert {c.name for c in step.checkpoints} == {"v000001", "step_000001"}
        with pytest.raises(ValueError, match="page_size"):
            model.history(page_size=5000)
        with model.watch(from_version=0) as events:
            first = next(events)
            assert (first.kind, first.policy_version, first.replayed) == ("version", 1, True)
            assert first.step == step
            _train(server, name, 2)
            live = next(events)
            assert (live.kind, live.policy_version, live.replayed) == ("version", 2, False)
        assert list(events) == []  # closed

    async def watch_async() -> list[tinkerrpc.ModelEvent]:
        async with tinkerrpc.AsyncClient(f"127.0.0.1:{server.port}") as client:
            model = client.model(name)
            assert [s.policy_version for s in (await model.history(from_version=2)).steps] == [2]
            seen = []
            async with model.watch(from_version=1) as events:
                async for event in events:
                    seen.append(event)
                    if event.policy_version == 2 and event.replayed:
                        await asyncio.to_thread(_train, server, name, 3)
                    if not event.replayed:
                        break
            return seen

    seen = asyncio.run(watch_async())
    assert [(e.kind, e.policy_version, e.replayed) for e in seen] == [
        ("version", 1, True),
        ("version", 2, True),
        ("version", 3, False),
    ]
