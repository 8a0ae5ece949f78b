from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_trainer import FAST_RETRY, FakeServer

import tinkerrpc


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(fake_server: FakeServer) -> Iterator[tinkerrpc.Client]:
    with tinkerrpc.Client(fake_server.target, retry=FAST_RETRY) as sync_client:
        yield sync_client
