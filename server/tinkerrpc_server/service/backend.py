"""Which Tinker the service talks to: Tinker itself (TINKER_API_KEY set) or the embedded engine, run as
a child process on a free loopback port and called with the key it was started with. Either way the
service only ever uses the tinker SDK."""

from __future__ import annotations

import contextlib
import logging
import os
from dataclasses import dataclass

import tinker

from tinkerrpc_server.local.engine_process import EmbeddedEngine

log = logging.getLogger("tinkerrpc.backend")

ENGINE_STARTUP_TIMEOUT = 180.0


@dataclass
class Backend:
    service: tinker.ServiceClient
    rest: tinker.RestClient
    url: str
    engine: EmbeddedEngine | None

    @property
    def embedded(self) -> bool:
        return self.engine is not None

    async def restart_engine(self) -> None:
        """After the engine child died: start a new one on a fresh port and point fresh SDK clients at it.
        Its data dir persists, so every tinker:// path stays valid."""
        assert self.engine is not None, "only the embedded engine is restarted"
        dead_service = self.service
        self.engine.respawn()
        await self.engine.wait_healthy(ENGINE_STARTUP_TIMEOUT)
        self.service = tinker.ServiceClient(base_url=self.engine.url, api_key=self.engine.api_key)
        self.rest = tinker.RestClient(base_url=self.engine.url, api_key=self.engine.api_key)
        self.url = self.engine.url
        # Stops the dead session's heartbeat loop; its engine is gone, so the result is not awaited.
        with contextlib.suppress(Exception):
            dead_service.close("errored", "embedded engine died")

    def close(self) -> None:
        """Finish the Tinker session (its owner, the CLI, stops the engine child afterwards)."""
        try:
            self.service.close("success").result(timeout=5)
        except Exception as err:
            log.warning("could not finish the Tinker session: %s", err)


async def connect_backend(
    engine: EmbeddedEngine | None, tinker_url: str | None, startup_timeout: float = ENGINE_STARTUP_TIMEOUT
) -> Backend:
    """Tinker itself when there is no engine (TINKER_API_KEY is set), else the embedded engine once healthy."""
    if engine is None:
        api_key = os.environ["TINKER_API_KEY"]
        url = tinker_url or os.environ.get("TINKER_BASE_URL") or ""
        log.info("using the Tinker service at %s", url or "the SDK's default URL")
        return Backend(
            service=tinker.ServiceClient(base_url=url or None, api_key=api_key),
            rest=tinker.RestClient(base_url=url or None, api_key=api_key),
            url=url,
            engine=None,
        )
    await engine.wait_healthy(startup_timeout)
    return Backend(
        service=tinker.ServiceClient(base_url=engine.url, api_key=engine.api_key),
        rest=tinker.RestClient(base_url=engine.url, api_key=engine.api_key),
        url=engine.url,
        engine=engine,
    )
