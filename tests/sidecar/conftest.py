"""Fixtures of the sidecar tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sidecar_support import MAX_STEPS, Sidecar, Stack, start_sidecar, teach_the_weather_tool

import tinkerrpc
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.processes.probes import free_port


@pytest.fixture(scope="module")
def orphan_sidecar(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Sidecar]:
    """A sidecar whose gRPC server is not running."""
    sidecar = start_sidecar(f"127.0.0.1:{free_port()}", tmp_path_factory.mktemp("orphan") / "sidecar.log")
    yield sidecar
    assert sidecar.stop() == 0, sidecar.log()[-2000:]


@pytest.fixture(scope="session")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("stack")
    with LocalStack(work / "data", work / "serve.log", startup_timeout=180) as server:
        sidecar = start_sidecar(server.target, work / "sidecar.log")
        client = tinkerrpc.Client(server.target)
        yield Stack(server.target, sidecar, client)
        client.close()
        assert sidecar.stop() == 0, sidecar.log()[-2000:]


@pytest.fixture(scope="session")
def tool_agent(stack: Stack) -> str:
    """`tool-agent@N`: a model version that calls the weather tool and then answers from its result
    (see sidecar_support's lesson); taught once for every module that needs it."""
    version = teach_the_weather_tool(stack.client)
    if version is None:
        pytest.fail(
            f"greedy decoding did not reproduce the weather-tool conversation after {MAX_STEPS} steps"
        )
    return version
