"""The service's rooms wired in-process over the fake backend (fake_backend.py): the store, model
registry, Train and checkpoints as `serve` wires them, without a process, a port or an engine."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from fake_backend import FakeTinker, FakeTrainingClient

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import retention
from tinkerrpc_server.service.checkpoints import Checkpoints
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.models import ModelRegistry
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.sample_cache import SampleCache, SamplerOf
from tinkerrpc_server.service.store import Store
from tinkerrpc_server.service.training import NoStepHooks, StepHooks, Trainer

TINY = "tinkerrpc/tiny-chat"


@dataclass
class InProcessService:
    store: Store
    fake: FakeTinker
    models: ModelRegistry
    trainer: Trainer
    checkpoints: Checkpoints
    sample_cache: SampleCache

    @classmethod
    def open(
        cls,
        db: Path,
        fake: FakeTinker,
        codecs: ChatCodecs,
        checkpoint_every: int = 1,
        limits: Limits | None = None,
        hooks: StepHooks | None = None,
        sample_cache: Callable[[SamplerOf], SampleCache] = SampleCache,
    ) -> InProcessService:
        """The service on the database `db` (a restart when it exists): its registry, as at start-up;
        `sample_cache` makes its sample cache over the store's sampler paths."""
        limits = limits or Limits()
        store = Store(db)
        backend = fake.backend()
        cache = sample_cache(store.sampler_path)
        models = ModelRegistry(store, backend, codecs, limits, cache)
        trainer = Trainer(store, models, checkpoint_every, limits, hooks or NoStepHooks(), cache)
        return cls(store, fake, models, trainer, Checkpoints(store, backend, models), cache)

    async def create(
        self, name: str, keep_sampler_versions: int | None = None, keep_state_checkpoints: int | None = None
    ) -> types_pb2.ModelInfo:
        request = pb.CreateModelRequest(name=name, base_model=TINY, lora=types_pb2.LoraConfig(rank=1), seed=7)
        if keep_sampler_versions is not None:
            request.keep_sampler_versions = keep_sampler_versions
        if keep_state_checkpoints is not None:
            request.keep_state_checkpoints = keep_state_checkpoints
        return await self.models.create(request)

    async def train(self, name: str, text: str, idempotency_key: str = "") -> pb.TrainResponse:
        """One supervised step on a one-example batch."""
        request = pb.TrainRequest(
            model=name, adam=types_pb2.AdamParams(learning_rate=1e-3), idempotency_key=idempotency_key
        )
        request.examples.add(
            messages=[
                types_pb2.Message(role=types_pb2.ROLE_USER, content=text),
                types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content=f"{text}, yes"),
            ]
        )
        response = await self.trainer.train(request)
        await self.models.tidied(name)
        return response

    async def training_client(self, name: str) -> FakeTrainingClient:
        client = await self.models.training_client(name, self.models.runtime(name))
        assert isinstance(client, FakeTrainingClient)
        return client

    async def settled(self) -> None:
        """Wait for the work the service leaves to the background: each commit's tidying and the
        unloading of dropped training clients (which nothing in the service waits for)."""
        await self.models.tidy_all()
        await asyncio.gather(*retention._unloading)

    def close(self) -> None:
        self.store.close()
