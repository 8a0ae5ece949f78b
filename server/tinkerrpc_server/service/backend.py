"""Which Tinker the service talks to: Tinker itself (a Tinker API key is set) or the embedded engine, a
child process the server was handed already starting (`EngineHandle`) and called with the key it was
started with. Either way the service only ever uses the tinker SDK; whoever built the engine knows how
to start it again, and the service asks it to through the handle."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Protocol

import tinker

from tinkerrpc_server.processes.children import StartError

__all__ = ["Backend", "EngineHandle", "StartError", "connect_backend"]

log = logging.getLogger("tinkerrpc.backend")


class EngineHandle(Protocol):
    """The embedded engine process as the service sees it. `wait_ready` and `restart` raise StartError
    when the engine exits before it serves, or does not serve in time."""

    @property
    def url(self) -> str: ...

    @property
    def api_key(self) -> str: ...

    @property
    def pid(self) -> int: ...

    def exit_code(self) -> int | None:
        """The exit code once the process has exited, else None."""
        ...

    async def wait_ready(self) -> None: ...

    async def exited(self) -> int:
        """The exit code, once the process exits."""
        ...

    async def restart(self) -> None:
        """Replace a dead engine with a new process (new port, new key, same data dir), once it serves."""
        ...


@dataclass
class Backend:
    service: tinker.ServiceClient
    rest: tinker.RestClient
    url: str
    engine: EngineHandle | None

    @property
    def embedded(self) -> bool:
        return self.engine is not None

    async def restart_engine(self) -> None:
        """After the engine child died: start a new one and point fresh SDK clients at it. Its data dir
        persists, so every tinker:// path stays valid."""
        assert self.engine is not None, "only the embedded engine is restarted"
        dead_service = self.service
        await self.engine.restart()
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
    engine: EngineHandle | None, tinker_api_key: str | None, tinker_url: str | None
) -> Backend:
    """Tinker itself at `tinker_url` (None: the SDK's default) when there is no engine, else the
    embedded engine once it serves."""
    if engine is None:
        if tinker_api_key is None:
            raise StartError("no embedded engine and no Tinker API key", None)
        log.info("using the Tinker service at %s", tinker_url or "the SDK's default URL")
        return Backend(
            service=tinker.ServiceClient(base_url=tinker_url, api_key=tinker_api_key),
            rest=tinker.RestClient(base_url=tinker_url, api_key=tinker_api_key),
            url=tinker_url or "",
            engine=None,
        )
    await engine.wait_ready()
    return Backend(
        service=tinker.ServiceClient(base_url=engine.url, api_key=engine.api_key),
        rest=tinker.RestClient(base_url=engine.url, api_key=engine.api_key),
        url=engine.url,
        engine=engine,
    )
