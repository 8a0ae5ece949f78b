"""Fixtures of the sidecar tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sidecar_support import Sidecar, Stack, start_sidecar

import tinkerrpc
from procs import Proc, free_port, tinkerrpc_cmd


@pytest.fixture(scope="module")
def orphan_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar whose gRPC server is not running."""
    sidecar = start_sidecar(f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("orphan") / "sidecar.log")
    yield sidecar
    assert sidecar.stop() == 0, sidecar.log()[-2000:]


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("stack")
    port = free_port()
    server = Proc(
        tinkerrpc_cmd("serve", "--port", str(port), "--data-dir", str(work / "data")), work / "serve.log"
    )
    target = f"127.0.0.1:{port}"
    try:
        client = tinkerrpc.Client(target, connect_timeout=180)
        sidecar = start_sidecar(target, work / "sidecar.log")
    except BaseException:
        server.stop()
        raise
    yield Stack(target, sidecar, client)
    client.close()
    sidecar_status = sidecar.stop()
    server.stop()
    assert sidecar_status == 0, sidecar.log()[-2000:]
