"""One base model's runtime, as the rest of the engine calls it: many named LoRA adapters trained side by
side, each concern in its own module of compute/: the base model and its adapters (adapters.py),
forward/backward passes (training.py), optimizer steps with their non-finite guard (optimizer.py), state
on disk (state_io.py) and sampling (sampling.py).

Synchronous and not thread-safe: the HTTP layer runs every call on one worker thread.
"""

from __future__ import annotations

from tinkerrpc_server.engine.compute.adapters import LORA_ALPHA, LoraSpec
from tinkerrpc_server.engine.compute.errors import NON_FINITE_UPDATE, EngineUserError, NonFiniteUpdateError
from tinkerrpc_server.engine.compute.optimizer import OptimizerSteps
from tinkerrpc_server.engine.compute.placement import PlacementError, resolve_placement
from tinkerrpc_server.engine.compute.sampling import SAMPLER_CACHE_SIZE, Sampling
from tinkerrpc_server.engine.compute.state_io import ADAPTER_WEIGHTS_FILE, OPTIMIZER_FILE
from tinkerrpc_server.engine.compute.training import DatumArrays, ForwardResult, Training, bucket_by_length

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


class BaseModelRuntime(Training, OptimizerSteps, Sampling):
    """`BaseModelRuntime(model_path, device, dtype, policy, plan)`: the base model at `model_path` on
    `device` with base weights in `dtype` (as in resolve_placement), its samples batched under `policy`
    unless a call says otherwise and computed with the kernels of the execution `plan` (None: the
    process's, compute/execution_plan.py)."""
