from __future__ import annotations

from pathlib import Path

import pytest

from tinkerrpc_server.engine.runtime import BaseModelRuntime
from tinkerrpc_server.model_store import TINY_CHAT, resolve_base_model


@pytest.fixture(scope="session")
def tiny_model_path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The built-in tiny chat model, generated once per test session into a temporary model dir."""
    return resolve_base_model(TINY_CHAT, tmp_path_factory.mktemp("models"))


@pytest.fixture(scope="module")
def runtime(tiny_model_path: Path) -> BaseModelRuntime:
    """One runtime per test module: modules stay independent, tests within one share the loaded model."""
    return BaseModelRuntime(tiny_model_path, device="cpu")
