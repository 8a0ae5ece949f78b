from __future__ import annotations

import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from hardening_support import (
    MAX_SAMPLE_N,
    MAX_SAMPLE_TOKENS,
    MAX_TRAIN_TOKENS,
    MAX_TRAIN_TRAJECTORIES,
    SIDECAR_KEY,
    HostedServer,
)
from service.svc import Server

# bench/ (bench.load) lives at the repository root, outside the installed packages.
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


@pytest.fixture(scope="session")
def hosted_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HostedServer]:
    """One `tinkerrpc serve` hosting the sidecar (1 MiB messages, small Sample/Train limits) for every test
    here but the lead's auth tests; each module uses its own models. test_limits_and_engine_faults SIGKILLs
    its engine child once (the server restarts it), so modules after it also run on a restarted engine."""
    tmp = tmp_path_factory.mktemp("hosted")
    server = Server(
        tmp / "data",
        tmp / "models",
        tmp / "serve.log",
        None,
        "--sidecar-port",
        "0",
        "--sidecar-api-key",
        SIDECAR_KEY,
        "--max-message-mb",
        "1",
        "--max-sample-n",
        str(MAX_SAMPLE_N),
        "--max-sample-tokens",
        str(MAX_SAMPLE_TOKENS),
        "--max-train-trajectories",
        str(MAX_TRAIN_TRAJECTORIES),
        "--max-train-tokens",
        str(MAX_TRAIN_TOKENS),
    )
    assert server.proc.sidecar_url is not None
    yield HostedServer(server, server.proc.sidecar_url)
    assert server.close() == 0, server.proc.log()[-3000:]
