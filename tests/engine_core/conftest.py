from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinkerrpc_server.engine.runtime import BaseModelRuntime, LoraSpec
from tinkerrpc_server.model_store import TINY_CHAT, resolve_base_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny chat model, generated once per test session into a temporary model dir."""
    return resolve_base_model(TINY_CHAT, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def runtime(tiny_model_path: Path) -> BaseModelRuntime:
    """One runtime per test module: modules stay independent, tests within one share the loaded model."""
    return BaseModelRuntime(tiny_model_path, device="cpu")


@pytest.fixture(scope="module")
def sampler_dir(runtime: BaseModelRuntime, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Sampler weights of an adapter with non-trivial weights, so samples differ from the base."""
    runtime.create_adapter("policy", LoraSpec(rank=8, seed=3))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in runtime.adapter_parameters("policy").values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    directory = tmp_path_factory.mktemp("sampler") / "policy-v1"
    runtime.save_state("policy", directory, include_optimizer=False)
    return directory
