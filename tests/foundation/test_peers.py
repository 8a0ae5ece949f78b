"""A loopback connection's peer is known by the uid owning its socket, read from the kernel's socket
table over netlink (processes.peers), for IPv4 and IPv6; a peer that has gone is unknown, not someone else."""

from __future__ import annotations

import os
import socket

import pytest

from tinkerrpc_server.processes.peers import Peer, identify, uid_lookup_available

pytestmark = [
    pytest.mark.unit,
    pytest.mark.skipif(not uid_lookup_available(), reason="the kernel answers no socket lookups here"),
]


@pytest.mark.parametrize(("family", "host"), [(socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")])
def test_a_loopback_peer_is_its_socket_owner(family: socket.AddressFamily, host: str) -> None:
    with socket.socket(family) as server:
        server.bind((host, 0))
        server.listen()
        with socket.create_connection(server.getsockname()[:2]) as client:
            accepted, _ = server.accept()
            with accepted:
                peer = identify(accepted.getpeername()[:2], accepted.getsockname()[:2])
                assert peer == Peer(host, True, os.getuid())
                assert peer.key == f"uid {os.getuid()}"
            client.close()


def test_a_departed_peer_is_unknown() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        client = socket.create_connection(server.getsockname())
        accepted, _ = server.accept()
        with accepted:
            ends = accepted.getpeername(), accepted.getsockname()
            client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
            client.close()  # a reset: the client's socket leaves the table at once
            assert identify(*ends) == Peer("127.0.0.1", True, None)


def test_a_remote_peer_is_its_address() -> None:
    peer = identify(("192.0.2.7", 40000), ("192.0.2.1", 8000))
    assert peer == Peer("192.0.2.7", False, None)
    assert peer.key == "192.0.2.7"
