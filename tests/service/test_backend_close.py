"""Shutdown closes what the service holds open on its backend (serve's last step, Backend.aclose): the
token streams' HTTP client, the Tinker session with the ServiceClient's connections, and the REST
client's connections, which the SDK would otherwise keep for the life of the process. Each refuses a
request afterwards instead of sending it on a connection left open."""

from __future__ import annotations

import asyncio
import os
import signal
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from svc import START_TIMEOUT

from tinkerrpc_server.engine.auth import HEALTH_PATH
from tinkerrpc_server.local.launch import EmbeddedEngine
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.service.backend import connect_backend

pytestmark = pytest.mark.process


@pytest.fixture
def engine(tmp_path: Path, service_model_dir: Path) -> Iterator[LocalEngine]:
    running = LocalEngine(
        tmp_path / "data", service_model_dir, tmp_path / "engine.log", START_TIMEOUT
    ).start()
    yield running
    assert running.stop() == 0, running.log()[-3000:]


def session_status(engine: LocalEngine, session_id: str) -> object:
    answer = httpx.post(
        f"{engine.base_url}/api/v1/sessions/search",
        json={"session_id": session_id},
        headers=engine.auth_headers,
        timeout=30,
    )
    assert answer.status_code == 200, answer.text
    (session,) = answer.json()["sessions"]
    return session["status"]


async def test_aclose_finishes_the_session_and_closes_every_client(engine: LocalEngine) -> None:
    backend = await connect_backend(None, engine.api_key, engine.base_url)
    streams = backend.token_stream_client()
    health = f"{engine.base_url}{HEALTH_PATH}"
    assert (await streams.get(health)).status_code == 200
    assert (await backend.rest.list_user_checkpoints()).checkpoints == []
    session_id = backend.session_id()
    assert session_status(engine, session_id) == {"type": "active"}

    await backend.aclose()

    assert session_status(engine, session_id) == {
        "type": "client_finished",
        "reason": {"type": "success"},
        "detail": None,
    }
    with pytest.raises(RuntimeError, match="closed"):
        await streams.get(health)
    with pytest.raises(RuntimeError, match="closed"):
        await backend.rest.list_user_checkpoints()


async def test_a_dead_engine_s_clients_stop_at_its_restart(tmp_path: Path, service_model_dir: Path) -> None:
    """The session died with its engine: restart_engine stops the old client's heartbeat at once instead
    of sending the SDK's finish, which retries against the dead port for 5 minutes while the heartbeat
    warns; the new clients serve."""
    engine = EmbeddedEngine(tmp_path / "data", service_model_dir, START_TIMEOUT)
    try:
        backend = await connect_backend(engine, None, None)
        dead = backend.service.holder
        assert dead._session_heartbeat_task is not None and not dead._session_heartbeat_task.done()
        os.kill(engine.pid, signal.SIGKILL)
        await asyncio.wait_for(engine.exited(), 30)

        await backend.restart_engine()

        for _ in range(50):
            if dead._session_heartbeat_task.done():
                break
            await asyncio.sleep(0.1)
        assert dead._session_heartbeat_task.done()
        assert backend.service.holder is not dead
        assert (await backend.rest.list_user_checkpoints()).checkpoints == []
        await backend.aclose()
    finally:
        engine.stop()
