"""Which Tinker the service talks to: Tinker itself (a Tinker API key is set) or the embedded engine, a
child process the server was handed already starting (`EngineHandle`) and called with the key it was
started with. Either way the service only ever uses the tinker SDK; whoever built the engine knows how
to start it again, and the service asks it to through the handle.

Everything the service makes on the backend lives in one Tinker session, opened with the SDK clients.
The backend may finish that session (no heartbeat for its timeout while this process was stopped, or a
holder of the key finished it): `session_finished` asks, and `renew_session` opens a new one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from dataclasses import dataclass, field
from typing import Protocol

import httpx
import tinker
from tinker.lib.base_url import resolve_base_url
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from tinkerrpc_server.processes.children import StartError

__all__ = ["Backend", "EngineHandle", "StartError", "connect_backend"]

log = logging.getLogger("tinkerrpc.backend")

# How long a Tinker at --tinker-url may take to answer the start-up probe and to open the SDK's session
# (the SDK retries a failing session request for minutes): past it, serve stops with one line.
TINKER_START_SECONDS = 30.0
# How long one heartbeat asking whether the session is still open may take; past it, the answer is
# "not known to be finished".
SESSION_PROBE_SECONDS = 5.0
# The status the Tinker API's session heartbeat answers for a finished session.
SESSION_FINISHED_STATUS = 410
# How long a token stream's connection to the engine may take to open (its tokens take as long as
# the sample does: no read timeout).
TOKEN_STREAM_CONNECT_SECONDS = 10.0
# How long shutdown waits for each SDK client to finish its session and close its connections.
CLOSE_SECONDS = 5.0


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
    """The SDK clients (`service` holds the session) and where they point: `url` as configured (the
    engine's, or --tinker-url; empty for the SDK's default), `base_url` resolved, `api_key` sent; and
    the HTTP client of the engine's token streams. `aclose` closes them all."""

    service: tinker.ServiceClient
    rest: tinker.RestClient
    url: str
    engine: EngineHandle | None
    base_url: str
    api_key: str
    _token_streams: httpx.AsyncClient | None = field(default=None, init=False, repr=False)

    @property
    def embedded(self) -> bool:
        return self.engine is not None

    @property
    def samples_topk(self) -> bool:
        """Whether the sample call answers the SDK's topk_sample_logprobs (the sampled tokens' top-k, from
        the distribution each token was drawn from): the embedded engine does; another Tinker's top-k comes
        from a second pass that scores prompt + completion (at temperature 1)."""
        return self.embedded

    async def restart_engine(self) -> None:
        """After the engine child died: start a new one and point fresh SDK clients at it. Its data dir
        persists, so every tinker:// path stays valid."""
        assert self.engine is not None, "only the embedded engine is restarted"
        # The session died with its engine: no finish is sent (the SDK would retry it for 5 minutes against
        # the dead port, its heartbeat warning meanwhile); the client's loops and connections stop now. The
        # SDK keeps a REST client's connections for the process, one set per URL and key: the dead engine's
        # are never used again.
        self.service.holder.close()
        self.rest.holder.close()
        await self.engine.restart()
        self.url = self.base_url = self.engine.url
        self.api_key = self.engine.api_key
        self.service, self.rest = await _open_clients(self.base_url, self.api_key)

    async def session_finished(self, service: tinker.ServiceClient) -> bool:
        """Whether the backend has finished `service`'s session: its heartbeat answers 410. A backend
        that does not answer in SESSION_PROBE_SECONDS (or fails otherwise) has not said so: False."""
        holder = service.holder

        async def heartbeat() -> None:
            with holder.aclient(ClientConnectionPoolType.SESSION) as http:
                await http.service.session_heartbeat(
                    session_id=holder.get_session_id(), max_retries=0, timeout=SESSION_PROBE_SECONDS
                )

        try:
            await asyncio.wait_for(holder.run_coroutine_threadsafe(heartbeat()), SESSION_PROBE_SECONDS + 1)
        except tinker.APIStatusError as err:
            return err.status_code == SESSION_FINISHED_STATUS
        except Exception:
            return False
        return False

    async def renew_session(self) -> None:
        """After the backend finished the session: fresh SDK clients with a new session (StartError when
        the backend does not open one). What the old session made is gone from the backend."""
        finished = self.service
        self.service, self.rest = await _open_clients(self.base_url, self.api_key)
        _let_go(finished, "the backend finished this session")

    def session_id(self) -> str:
        return self.service.holder.get_session_id()

    def token_stream_client(self) -> httpx.AsyncClient:
        """The one HTTP client of every token stream, made on first use: making one costs tens of
        milliseconds (its TLS context), which a stream's first token would wait for."""
        if self._token_streams is None:
            self._token_streams = httpx.AsyncClient(
                timeout=httpx.Timeout(None, connect=TOKEN_STREAM_CONNECT_SECONDS)
            )
        return self._token_streams

    async def aclose(self) -> None:
        """At shutdown: close the token streams' client, finish the Tinker session (which closes the
        ServiceClient's connections) and close the REST client's. Its owner, the CLI, stops the engine
        child afterwards."""
        if self._token_streams is not None:
            await self._token_streams.aclose()
        await asyncio.to_thread(self._close_sdk_clients)

    def _close_sdk_clients(self) -> None:
        try:
            self.service.close("success").result(timeout=CLOSE_SECONDS)
        except Exception as err:
            log.warning("could not finish the Tinker session: %s", err)
        holder = self.rest.holder
        try:
            holder.run_coroutine_threadsafe(holder.aclose()).result(timeout=CLOSE_SECONDS)
        except Exception as err:
            log.warning("could not close the Tinker REST client: %s", err)


def _let_go(service: tinker.ServiceClient, detail: str) -> None:
    """Stop a replaced client's session loops (heartbeat and the rest). Its session is finished, so the
    result is not awaited."""
    with contextlib.suppress(Exception):
        service.close("errored", detail)


async def connect_backend(
    engine: EngineHandle | None, tinker_api_key: str | None, tinker_url: str | None
) -> Backend:
    """Tinker itself at `tinker_url` (None: the SDK's default) when there is no engine, else the
    embedded engine once it serves; with the session open."""
    if engine is None:
        if tinker_api_key is None:
            raise StartError("no embedded engine and no Tinker API key", None)
        log.info("using the Tinker service at %s", tinker_url or "the SDK's default URL")
        url = resolve_base_url(tinker_url)
        await _probe_tinker(url, tinker_api_key)
        service, rest = await _open_clients(url, tinker_api_key)
        return Backend(service, rest, tinker_url or "", None, url, tinker_api_key)
    await engine.wait_ready()
    service, rest = await _open_clients(engine.url, engine.api_key)
    return Backend(service, rest, engine.url, engine, engine.url, engine.api_key)


async def _probe_tinker(url: str, api_key: str) -> None:
    """StartError (one line) when the Tinker at `url` cannot be reached or answers its health route with
    a server error or an authentication refusal; a backend without that route (404) is let through."""
    health = f"{url.rstrip('/')}/api/v1/healthz"
    try:
        async with httpx.AsyncClient(timeout=TINKER_START_SECONDS) as http:
            answer = await http.get(health, headers={"X-API-Key": api_key})
    except httpx.HTTPError as err:
        raise StartError(
            f"the Tinker at {url} cannot be reached: {err or type(err).__name__}", None
        ) from None
    if answer.status_code >= 500 or answer.status_code in (401, 403):
        detail = " ".join(answer.text.split())[:200]
        raise StartError(
            f"the Tinker at {url} answered GET /api/v1/healthz with {answer.status_code}: {detail}", None
        )


async def _open_clients(url: str, api_key: str) -> tuple[tinker.ServiceClient, tinker.RestClient]:
    """The SDK clients with their session open; opening it blocks and retries, so it runs on a daemon
    thread of its own (one left behind past the deadline does not keep the process alive)."""
    loop = asyncio.get_running_loop()
    made: asyncio.Future[tuple[tinker.ServiceClient, tinker.RestClient]] = loop.create_future()

    def make() -> None:
        try:
            service = tinker.ServiceClient(base_url=url, api_key=api_key)
            service.holder.get_session_id()  # the SDK opens the session on first use: here
            clients = (service, tinker.RestClient(base_url=url, api_key=api_key))
        except Exception as err:
            loop.call_soon_threadsafe(_settle_failed, made, err)
        else:
            loop.call_soon_threadsafe(_settle, made, clients)

    threading.Thread(target=make, name="tinker-session", daemon=True).start()
    try:
        return await asyncio.wait_for(asyncio.shield(made), TINKER_START_SECONDS)
    except TimeoutError:
        raise StartError(
            f"the Tinker at {url} did not open a session within {TINKER_START_SECONDS:.0f} s", None
        ) from None
    except Exception as err:
        raise StartError(f"the Tinker at {url} refused a session: {err}", None) from None


def _settle(
    future: asyncio.Future[tuple[tinker.ServiceClient, tinker.RestClient]],
    clients: tuple[tinker.ServiceClient, tinker.RestClient],
) -> None:
    if not future.done():
        future.set_result(clients)


def _settle_failed(
    future: asyncio.Future[tuple[tinker.ServiceClient, tinker.RestClient]], err: Exception
) -> None:
    if not future.done():
        future.set_exception(err)
