"""A real engine process on 127.0.0.1 per test module, driven through the real tinker SDK."""

from __future__ import annotations

import gc
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import tinker
from engine_proc import start_engine
from tinker.lib.base_url import resolve_base_url
from tinker.lib.internal_client_holder import InternalClientHolder

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
    assert not heartbeats_outliving(running.base_url), "a client of this module's engine was left open"


def heartbeats_outliving(base_url: str, wait: float = 5.0) -> list[str]:
    """The sessions of the SDK clients in this process still heartbeating to `base_url`, `wait` seconds
    after their engine stopped (closing one stops its heartbeat on the SDK's loop, a moment later). A client
    left open warns every 10 s for the rest of the test run."""
    deadline, url = time.monotonic() + wait, resolve_base_url(base_url)
    while True:
        live = [
            holder.get_session_id()
            for holder in gc.get_objects()
            if isinstance(holder, InternalClientHolder)
            and holder._base_url == url
            and holder._session_heartbeat_task is not None
            and not holder._session_heartbeat_task.done()
        ]
        if not live or time.monotonic() > deadline:
            return live
        time.sleep(0.2)


@pytest.fixture(scope="module")
def service(engine: LocalEngine) -> Iterator[tinker.ServiceClient]:
    # Closed while its engine still runs: an open session keeps heartbeating (and warning) until exit.
    with engine.service_client() as client:
        yield client
