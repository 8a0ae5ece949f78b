"""Fixtures of the sidecar tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sidecar_support import Sidecar, start_sidecar

from procs import free_port


@pytest.fixture(scope="module")
def orphan_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar whose gRPC server is not running."""
    sidecar = start_sidecar(f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("orphan") / "sidecar.log")
    yield sidecar
    assert sidecar.proc.stop() == 0, sidecar.proc.log()[-2000:]
