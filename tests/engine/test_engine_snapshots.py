"""Unnamed sampler snapshots live as long as a client uses them: a superseded one stays while a sampling
session or request refers to it (an off-policy rollout still samples from it), goes once its session has
finished and the snapshot grace has passed, and at most UNNAMED_SNAPSHOTS_KEPT_PER_MODEL stay per
training client. The engine runs in this process (its app factory takes a short grace) on 127.0.0.1,
driven through the tinker SDK alone."""

from __future__ import annotations

import asyncio
import os
import secrets
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import tinker
import uvicorn
from tinker import types

from tinkerrpc_server.engine.app import create_app
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.snapshots import UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
from tinkerrpc_server.processes.http_serving import OWNER_ONLY, bound_port, listen, serve_until_stopped

pytestmark = pytest.mark.process

GRACE = 0.5
TINY = "tinkerrpc/tiny-chat"


@dataclass
class InProcessEngine:
    base_url: str
    api_key: str
    data_dir: Path

    def service_client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[InProcessEngine]:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = tmp_path_factory.mktemp("snapshots")
    api_key = f"tml-{secrets.token_hex(16)}"
    app = create_app(EngineConfig(work / "data", work / "models", api_key, snapshot_grace=GRACE))
    sock = listen("127.0.0.1", 0)  # connections queue from here on: no wait for the server to start
    loop = asyncio.new_event_loop()
    stop = asyncio.Event()
    config = uvicorn.Config(app, access_log=False, log_level="warning", timeout_graceful_shutdown=3)
    serving = threading.Thread(
        target=loop.run_until_complete,
        args=(serve_until_stopped(config, sock, OWNER_ONLY, stop),),
        daemon=True,
    )
    serving.start()
    yield InProcessEngine(f"http://127.0.0.1:{bound_port(sock)}", api_key, work / "data")
    loop.call_soon_threadsafe(stop.set)
    serving.join(timeout=30)
    assert not serving.is_alive()
    loop.close()


def _sample(client: tinker.SamplingClient) -> list[int]:
    prompt = types.ModelInput.from_ints([1, 2, 3])
    params = types.SamplingParams(max_tokens=3, temperature=1.0, seed=5)
    result = client.sample(prompt, num_samples=1, sampling_params=params).result(timeout=120)
    return list(result.sequences[0].tokens)


def _sampler_paths(engine: InProcessEngine, model_id: str) -> set[str]:
    rest = tinker.RestClient(base_url=engine.base_url, api_key=engine.api_key)
    listed = rest.list_checkpoints(model_id).result().checkpoints
    return {c.tinker_path for c in listed if c.checkpoint_type == "sampler"}


def _train_step(client: tinker.TrainingClient) -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2, 3, 4]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=[2, 3, 4, 5], dtype="int64", shape=[4]),
            "weights": types.TensorData(data=[1.0] * 4, dtype="float32", shape=[4]),
        },
    )
    client.forward_backward([datum], "cross_entropy").result(timeout=120)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=120)


def test_an_older_sampling_client_samples_after_a_newer_snapshot_until_its_session_ends(
    engine: InProcessEngine,
) -> None:
    service = engine.service_client()
    trainer = service.create_lora_training_client(base_model=TINY, rank=2).result()
    first = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    _train_step(trainer)
    second = trainer.save_weights_and_get_sampling_client().result(timeout=120)
    # The off-policy rollout's case: the first client samples after the second snapshot exists.
    assert len(_sample(first)) == 3
    assert len(_sample(second)) == 3
    assert len(_sampler_paths(engine, trainer.model_id)) == 2
    service.close("success").result(timeout=30)
    # Its session finished: nothing refers to the snapshots, so the sweep deletes them after the grace.
    deadline = time.monotonic() + 30
    while _sampler_paths(engine, trainer.model_id) and time.monotonic() < deadline:
        time.sleep(GRACE / 2)
    assert _sampler_paths(engine, trainer.model_id) == set()
    assert not list((engine.data_dir / "runs" / trainer.model_id / "sampler_weights").iterdir())


def test_unnamed_snapshots_on_disk_stay_bounded_oldest_first(engine: InProcessEngine) -> None:
    with engine.service_client() as service:
        trainer = service.create_lora_training_client(base_model=TINY, rank=2).result()
        clients = [trainer.save_weights_and_get_sampling_client().result(timeout=120)]
        paths = [next(iter(_sampler_paths(engine, trainer.model_id)))]
        for _ in range(UNNAMED_SNAPSHOTS_KEPT_PER_MODEL + 1):
            clients.append(trainer.save_weights_and_get_sampling_client().result(timeout=120))
            paths.append(next(iter(_sampler_paths(engine, trainer.model_id) - set(paths))))
        # Every client is still held (its session lives): the cap alone bounds the disk.
        kept = _sampler_paths(engine, trainer.model_id)
        assert kept == set(paths[-UNNAMED_SNAPSHOTS_KEPT_PER_MODEL:])
        with pytest.raises(tinker.RequestFailedError, match="were deleted"):
            _sample(clients[0])
        assert len(_sample(clients[2])) == 3
