from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from svc import Server

from tinkerrpc_server.service.rendering import ChatCodecs


@pytest.fixture(scope="session")
def service_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """One model dir for every server of these tests: tiny-chat is built once."""
    return tmp_path_factory.mktemp("service-models")


@pytest.fixture(scope="session")
def server(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[Server]:
    """One `tinkerrpc serve` (and its engine child) shared by the service tests; each module uses its
    own models so tests do not see each other's versions."""
    tmp = tmp_path_factory.mktemp("service")
    running = Server(tmp / "data", service_model_dir, tmp / "serve.log")
    yield running
    assert running.close() == 0, running.proc.log()[-3000:]


@pytest.fixture(scope="session")
def codecs(service_model_dir: Path) -> ChatCodecs:
    """The chat codecs of the in-process service tests (tiny-chat's tokenizer and renderer, loaded once)."""
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False)
