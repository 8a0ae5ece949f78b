"""The one way an HTTP server (the engine, the sidecar) runs under uvicorn and stops.

The caller binds the listening socket (`listen`, port 0 for one the kernel picks) and learns the port
before anything serves; the server then accepts on that socket only.

uvicorn's own signal handling re-raises SIGTERM once it has shut down, so a process would die by the
signal instead of exiting 0, and it replaces the handlers of a process that hosts it next to other
servers. Here the caller's event loop owns the signals: either this module installs them for a whole
process (`serve_until_signalled`), or the host sets an event (`serve_until_stopped`).

Slow or idle clients cannot hold the server's file descriptors: every server here speaks HTTP/1.1
through `BoundedH11Protocol`, which closes a connection whose request headers are not complete within
HEADER_READ_TIMEOUT_SECONDS, or whose body stops arriving for BODY_READ_IDLE_SECONDS, and closes at once
(after a one-line 503) a connection beyond MAX_CONNECTIONS or beyond the share one peer may hold
(`Admission.per_peer`: a local uid, or a remote address), so one client cannot take every slot; a server
whose `Admission.owner_only` is set (the engine) refuses at once a loopback peer of another uid, before
it holds a slot (`peers`). uvicorn's keep-alive timeout closes idle
connections between requests. When the process still runs out of descriptors, asyncio's "accept out of
system resource" error is logged once per ACCEPT_ERROR_LOG_INTERVAL_SECONDS with a count, not per
attempt.

uvicorn has no public header-read deadline or connection cap that answers before a request's headers
arrive, so `BoundedH11Protocol` subclasses its h11 protocol and reads its connection state (`conn`,
`connections`, `flow`, `transport`, `loop`); pyproject.toml pins uvicorn to the minor versions where
those are as used here.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from tinkerrpc_server.processes.peers import Peer, identify, uid_lookup_available

log = logging.getLogger("tinkerrpc.http")

HEADER_READ_TIMEOUT_SECONDS = 10.0
BODY_READ_IDLE_SECONDS = 30.0
MAX_CONNECTIONS = 256
ACCEPT_ERROR_LOG_INTERVAL_SECONDS = 60.0


def _plain_reply(status: str, text: str) -> bytes:
    body = text.encode() + b"\n"
    head = f"HTTP/1.1 {status}\r\ncontent-type: text/plain\r\nconnection: close\r\ncontent-length: {len(body)}\r\n\r\n"
    return head.encode() + body


_TOO_MANY_CONNECTIONS = _plain_reply("503 Service Unavailable", "too many connections")
_TOO_MANY_FROM_PEER = _plain_reply("503 Service Unavailable", "too many connections from this client")
_NOT_THE_OWNER = _plain_reply("403 Forbidden", "only the server owner's processes may connect")


@dataclass(frozen=True)
class Admission:
    """Which connections a server takes, decided as each is accepted, before it holds a slot."""

    # Loopback peers of another uid are refused: for a server only its owner's processes hold the key of.
    owner_only: bool
    # Connections one peer (a local uid, or a remote address) may hold at once.
    per_peer: int

    def __post_init__(self) -> None:
        if not 1 <= self.per_peer <= MAX_CONNECTIONS:
            raise ValueError(f"per_peer must be in [1, {MAX_CONNECTIONS}], got {self.per_peer}")


# A server any client may reach (the sidecar): one client holds at most half the slots.
SHARED = Admission(owner_only=False, per_peer=MAX_CONNECTIONS // 2)
# The engine: its key is in its owner's processes only, so a local user of another uid holds no slot.
OWNER_ONLY = Admission(owner_only=True, per_peer=MAX_CONNECTIONS)


class BoundedH11Protocol(H11Protocol):
    """uvicorn's h11 protocol with a read deadline on each request, a cap on open connections in all and
    per peer, and the server's `Admission`."""

    admission: ClassVar[Admission] = SHARED
    peer: Peer | None = None
    _read_timer: asyncio.TimerHandle | None = None
    _reading_headers = False
    _refused = False

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        _no_delay(transport)
        self.peer = identify(transport.get_extra_info("peername"), transport.get_extra_info("sockname"))
        refusal = self._refusal()
        if refusal is not None:
            # Not tracked in self.connections: connection_lost only closes the transport.
            self._refused = True
            self.transport = transport
            transport.write(refusal)
            transport.close()
            return
        super().connection_made(transport)
        self._watch_request_read(bytes_arrived=True)

    def _refusal(self) -> bytes | None:
        """The reply that refuses this connection, or None to take it."""
        if len(self.connections) >= MAX_CONNECTIONS:
            return _TOO_MANY_CONNECTIONS
        peer = self.peer
        if peer is None:
            return None
        # Where the kernel cannot name a socket's owner (not Linux) only the budgets apply.
        if self.admission.owner_only and peer.local and uid_lookup_available() and peer.uid != os.getuid():
            log.debug("refusing %s: uid %s is not the server's", peer.address, peer.uid)
            return _NOT_THE_OWNER
        held = sum(
            1
            for other in self.connections
            if (other_peer := getattr(other, "peer", None)) and other_peer.key == peer.key
        )
        if held >= self.admission.per_peer:
            return _TOO_MANY_FROM_PEER
        return None

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_read_timer()
        if self._refused:
            self.transport.close()
            return
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        super().data_received(data)
        self._watch_request_read(bytes_arrived=True)

    def on_response_complete(self) -> None:
        super().on_response_complete()
        # Between requests the keep-alive timeout applies; the next request's first bytes start its own.
        self._watch_request_read(bytes_arrived=False)

    def _watch_request_read(self, bytes_arrived: bool) -> None:
        """Arm the deadline of the request being received: its headers from its first byte (or the
        connection's start), then each chunk of its body; none once it has arrived."""
        if self.transport.is_closing():
            self._cancel_read_timer()
            return
        state = self.conn.their_state
        if state is h11.IDLE:
            if bytes_arrived and not self._reading_headers:
                self._arm_read_timer(HEADER_READ_TIMEOUT_SECONDS)
                self._reading_headers = True
            elif not bytes_arrived:
                self._cancel_read_timer()
        elif state is h11.SEND_BODY:
            if bytes_arrived or self._reading_headers:
                self._arm_read_timer(BODY_READ_IDLE_SECONDS)
        else:
            self._cancel_read_timer()

    def _arm_read_timer(self, seconds: float) -> None:
        self._cancel_read_timer()
        self._reading_headers = False
        self._read_timer = self.loop.call_later(seconds, self._read_timed_out, seconds)

    def _cancel_read_timer(self) -> None:
        self._reading_headers = False
        if self._read_timer is not None:
            self._read_timer.cancel()
            self._read_timer = None

    def _read_timed_out(self, seconds: float) -> None:
        self._read_timer = None
        if self.flow.read_paused:
            # The application has not consumed the body yet: the client is not the slow one.
            self._arm_read_timer(seconds)
            return
        log.debug("closing %s: request not received within %.0f s", self.client, seconds)
        self.transport.close()


class _AcceptErrorLimiter:
    """A loop exception handler that logs accept failures for lack of descriptors once per interval
    (with how many there were) and passes every other error to the handler it replaces."""

    MESSAGE = "socket.accept() out of system resource"

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._previous = loop.get_exception_handler()
        self._suppressed = 0
        self._last_logged: float | None = None

    def __call__(self, loop: asyncio.AbstractEventLoop, context: dict[str, Any]) -> None:
        if context.get("message") != self.MESSAGE:
            if self._previous is not None:
                self._previous(loop, context)
            else:
                loop.default_exception_handler(context)
            return
        now = time.monotonic()
        if self._last_logged is not None and now - self._last_logged < ACCEPT_ERROR_LOG_INTERVAL_SECONDS:
            self._suppressed += 1
            return
        log.error(
            "cannot accept connections: %s (%d more in the last %.0f s); the process is out of file "
            "descriptors",
            context.get("exception"),
            self._suppressed,
            ACCEPT_ERROR_LOG_INTERVAL_SECONDS,
        )
        self._suppressed = 0
        self._last_logged = now

    @contextlib.contextmanager
    def installed(self) -> Iterator[None]:
        self._loop.set_exception_handler(self)
        try:
            yield
        finally:
            self._loop.set_exception_handler(self._previous)


class _LoopOwnsSignals(uvicorn.Server):
    """A uvicorn server that neither installs signal handlers nor re-raises a signal at the end, and
    speaks through BoundedH11Protocol under `admission`."""

    def __init__(self, config: uvicorn.Config, admission: Admission) -> None:
        config.http = type("AdmittingH11Protocol", (BoundedH11Protocol,), {"admission": admission})
        super().__init__(config)

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def _no_delay(transport: asyncio.Transport) -> None:
    """Send each write at once. asyncio sets TCP_NODELAY only on sockets whose proto is IPPROTO_TCP, and
    one made as `listen` makes it (proto 0) is not: h11 writes a response's headers and body apart, and
    Nagle held the body until the client's delayed ACK, ~40 ms on every request on Linux loopback."""
    sock = transport.get_extra_info("socket")
    if sock is not None and sock.family in (socket.AF_INET, socket.AF_INET6):
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


def listen(host: str, port: int, backlog: int = 2048) -> socket.socket:
    """A socket listening on `host:port` as uvicorn would bind it (SO_REUSEADDR, no SO_REUSEPORT, so a
    port in TIME_WAIT is free and a port in use is refused); port 0 takes one the kernel picks.
    Connections queue from here on, so a client that connects before the server accepts is answered."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host.strip("[]"), port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


def bound_port(sock: socket.socket) -> int:
    return int(sock.getsockname()[1])


def serve_until_signalled(
    config: uvicorn.Config,
    sock: socket.socket,
    admission: Admission,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve on `sock` as the whole process until SIGTERM or SIGINT, then return after the graceful
    shutdown, so the process exits 0. A second SIGINT stops waiting for open connections, as in uvicorn.
    `on_serving` runs once the signals are handled here (a SIGTERM after it is a clean stop)."""
    server = _LoopOwnsSignals(config, admission)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.handle_exit, sig, None)
        if on_serving is not None:
            on_serving()
        with _AcceptErrorLimiter(loop).installed():
            await server.serve(sockets=[sock])

    asyncio.run(serve())


async def serve_until_stopped(
    config: uvicorn.Config, sock: socket.socket, admission: Admission, stop: asyncio.Event
) -> None:
    """Serve on `sock` on the running loop, whose owner handles the signals, until `stop` is set; then
    shut down gracefully."""
    server = _LoopOwnsSignals(config, admission)
    with _AcceptErrorLimiter(asyncio.get_running_loop()).installed():
        serving = asyncio.create_task(server.serve(sockets=[sock]))
        stopping = asyncio.create_task(stop.wait())
        await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
        server.should_exit = True
        stopping.cancel()
        await serving
