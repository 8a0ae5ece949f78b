"""A real engine process on 127.0.0.1 per test module, driven through the real tinker SDK."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from engine_proc import start_engine

from tinkerrpc_server.local.stack import LocalEngine


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[LocalEngine]:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = tmp_path_factory.mktemp("engine")
    running = start_engine(work / "data", model_dir, work / "engine.log")
    yield running
    assert running.stop() == 0, running.log()[-3000:]


@pytest.fixture(scope="module")
def service(engine: LocalEngine) -> Iterator[tinker.ServiceClient]:
    # Closed while its engine still runs: an open session keeps heartbeating (and warning) until exit.
    with engine.service_client() as client:
        yield client
