"""The HTTP servers' sockets (the engine's and the sidecar's, both from `http_serving.listen`)."""

from __future__ import annotations

import asyncio
import socket

import pytest

from tinkerrpc_server.processes.http_serving import _no_delay, listen

pytestmark = pytest.mark.unit


async def _accepted_nodelay(fix: bool) -> int:
    """TCP_NODELAY of a connection accepted by an asyncio server on a `listen` socket."""
    seen: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    class Probe(asyncio.Protocol):
        def connection_made(self, transport: asyncio.BaseTransport) -> None:
            assert isinstance(transport, asyncio.Transport)
            if fix:
                _no_delay(transport)
            sock = transport.get_extra_info("socket")
            seen.set_result(sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    server = await asyncio.get_running_loop().create_server(Probe, sock=listen("127.0.0.1", 0))
    async with server:
        port = server.sockets[0].getsockname()[1]
        _, writer = await asyncio.open_connection("127.0.0.1", port)
        value = await asyncio.wait_for(seen, 10)
        writer.close()
    return value


async def test_connections_send_without_waiting_for_the_peer_s_ack() -> None:
    # asyncio turns Nagle off only for sockets made with proto IPPROTO_TCP; `listen` makes proto 0, and
    # h11's separate header and body writes then waited ~40 ms for the client's delayed ACK.
    assert await _accepted_nodelay(fix=False) == 0
    assert await _accepted_nodelay(fix=True) != 0
