from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tinkerrpc_server.model_store import TINY_CHAT, resolve_base_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny chat model, generated once per test session into a temporary model dir."""
    return resolve_base_model(TINY_CHAT, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="session", autouse=True)
def single_torch_thread() -> None:
    """The tiny model's ops are too small to split; on a shared 2-core CI box extra intra-op
    threads only spin against the engine processes other tests start (measured 4-30x slower)."""
    torch.set_num_threads(1)
