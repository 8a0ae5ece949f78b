from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_trainer import FakeServer

import tinkerrpc

# Backoffs short enough that retry tests stay fast; the decisions under test are the same.
FAST_RETRY = tinkerrpc.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)


@pytest.fixture(scope="session")
def fake_server() -> Iterator[FakeServer]:
    server = FakeServer().start()
    yield server
    server.stop()


@pytest.fixture(scope="session")
def client(fake_server: FakeServer) -> Iterator[tinkerrpc.Client]:
    with tinkerrpc.Client(fake_server.target, retry=FAST_RETRY) as sync_client:
        yield sync_client
