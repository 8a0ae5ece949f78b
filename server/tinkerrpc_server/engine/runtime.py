"""One base model's runtime, as the rest of the engine calls it: many named LoRA adapters trained side by
side (compute/adapters.py, compute/training.py), their optimizer steps (compute/optimizer.py), their state
on disk (compute/state_io.py) and sampling (compute/sampling.py).

Synchronous and not thread-safe: the HTTP layer runs every call on one worker thread.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tinkerrpc_server.engine.compute import optimizer, state_io, training
from tinkerrpc_server.engine.compute.adapters import LORA_ALPHA, AdaptedModel, LoraSpec
from tinkerrpc_server.engine.compute.errors import NON_FINITE_UPDATE, EngineUserError, NonFiniteUpdateError
from tinkerrpc_server.engine.compute.feed import RequestFeed
from tinkerrpc_server.engine.compute.placement import PlacementError, resolve_placement
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.compute.sampling import SAMPLER_CACHE_SIZE, SampleRunner
from tinkerrpc_server.engine.compute.scheduler import BatchPolicy
from tinkerrpc_server.engine.compute.state_io import ADAPTER_WEIGHTS_FILE, OPTIMIZER_FILE
from tinkerrpc_server.engine.compute.training import DatumArrays, ForwardResult, bucket_by_length

__all__ = [
    "ADAPTER_WEIGHTS_FILE",
    "LORA_ALPHA",
    "NON_FINITE_UPDATE",
    "OPTIMIZER_FILE",
    "SAMPLER_CACHE_SIZE",
    "BaseModelRuntime",
    "DatumArrays",
    "EngineUserError",
    "ForwardResult",
    "LoraSpec",
    "NonFiniteUpdateError",
    "PlacementError",
    "bucket_by_length",
    "resolve_placement",
]


class BaseModelRuntime:
    """The base model at `model_path` on `device` with base weights in `dtype` (as in resolve_placement),
    its samples batched under `policy` unless a call says otherwise."""

    def __init__(
        self,
        model_path: Path,
        device: str | None = None,
        dtype: str | None = None,
        policy: BatchPolicy | None = None,
    ) -> None:
        self.model = AdaptedModel(model_path, device, dtype)
        self.sampling = SampleRunner(self.model, policy)

    @property
    def device(self) -> torch.device:
        return self.model.device

    @property
    def tokenizer(self) -> Any:
        return self.model.tokenizer

    @property
    def vocab_size(self) -> int:
        return self.model.vocab_size

    @property
    def max_context_length(self) -> int:
        return self.model.max_context_length

    @property
    def default_stop_token_ids(self) -> list[int]:
        return self.sampling.default_stop_token_ids

    def has_adapter(self, model_id: str) -> bool:
        return self.model.has_adapter(model_id)

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        self.model.create_adapter(model_id, lora)

    def delete_adapter(self, model_id: str) -> None:
        self.model.delete_adapter(model_id)

    def adapter_parameters(self, model_id: str) -> dict[str, torch.nn.Parameter]:
        return self.model.adapter_parameters(model_id)

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
    ) -> ForwardResult:
        return training.forward_backward(self.model, model_id, data, loss_fn, loss_fn_config, backward)

    def optim_step(
        self,
        model_id: str,
        learning_rate: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, float]:
        return optimizer.optim_step(
            self.model, model_id, learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm
        )

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> None:
        state_io.save_state(self.model, model_id, directory, include_optimizer)

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        return state_io.load_state(self.model, model_id, directory, include_optimizer)

    def sample(
        self, weights_dir: Path | None, jobs: list[SampleJob], policy: BatchPolicy | None = None
    ) -> list[SampleOutput]:
        return self.sampling.sample(weights_dir, jobs, policy)

    def serve_samples(
        self,
        weights_dir: Path | None,
        feed: RequestFeed[SampleJob, SampleOutput | EngineUserError],
        policy: BatchPolicy | None = None,
    ) -> None:
        self.sampling.serve_samples(weights_dir, feed, policy)
