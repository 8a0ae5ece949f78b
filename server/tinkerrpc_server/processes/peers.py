"""Who is on the other end of an accepted TCP connection, for admitting it before it holds a slot.

A peer on another machine is known by its address only. A peer on this machine (a loopback address) is
known by the uid that owns its socket: the client's end of our connection, which the kernel finds by its
four addresses when asked over netlink (sock_diag, what `ss` uses; one hash lookup, about 0.2 ms, where
reading /proc/net/tcp costs milliseconds a connection). Where the kernel cannot be asked (not Linux, no
sock_diag) `uid_lookup_available()` is False.
"""

from __future__ import annotations

import errno
import functools
import ipaddress
import socket
import struct
from typing import NamedTuple

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLMSG_ERROR = 2
_NLM_F_REQUEST = 1
_ALL_STATES = 0xFFFFFFFF
_NO_COOKIE = 0xFFFFFFFF
_TCP_TIME_WAIT = 6
_NLMSG_HEADER = struct.Struct("=IHHII")
# inet_diag_msg after the netlink header: family, state, timer, retrans, the 48-byte socket id, expires,
# rqueue, wqueue, then the owner's uid.
_DIAG_STATE_OFFSET = _NLMSG_HEADER.size + 1
_DIAG_UID_OFFSET = _NLMSG_HEADER.size + 64

Address = ipaddress.IPv4Address | ipaddress.IPv6Address


class Peer(NamedTuple):
    """A connection's other end: for a loopback peer (`local`), the uid owning its socket when the kernel
    lists it, else None."""

    address: str
    local: bool
    uid: int | None

    @property
    def key(self) -> str:
        """What one client is counted by: its uid on this machine, its address otherwise."""
        return f"uid {self.uid}" if self.uid is not None else self.address


def _plain(address: Address) -> Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it carries (the kernel lists it as IPv4)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _ask_kernel(client: tuple[Address, int], server: tuple[Address, int]) -> tuple[int, bytes]:
    """sock_diag's answer for the TCP socket whose own end is `client` and whose peer is `server`: the
    netlink message type and the message."""
    family = socket.AF_INET if client[0].version == 4 else socket.AF_INET6
    socket_id = (
        struct.pack("!HH", client[1], server[1])
        + client[0].packed.ljust(16, b"\0")
        + server[0].packed.ljust(16, b"\0")
        + struct.pack("=III", 0, _NO_COOKIE, _NO_COOKIE)
    )
    request = struct.pack("=BBBBI", family, socket.IPPROTO_TCP, 0, 0, _ALL_STATES) + socket_id
    header = _NLMSG_HEADER.pack(_NLMSG_HEADER.size + len(request), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, 1, 0)
    with socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG) as kernel:
        kernel.settimeout(1.0)
        kernel.send(header + request)
        answer = kernel.recv(8192)
    return _NLMSG_HEADER.unpack_from(answer)[1], answer


@functools.cache
def uid_lookup_available() -> bool:
    """Whether the kernel answers socket lookups: asked once for a socket that does not exist, it must
    say exactly that (ENOENT)."""
    if not hasattr(socket, "AF_NETLINK"):
        return False
    nowhere = (ipaddress.ip_address("127.0.0.1"), 1)
    try:
        kind, answer = _ask_kernel(nowhere, nowhere)
    except OSError:
        return False
    return kind == _NLMSG_ERROR and struct.unpack_from("=i", answer, _NLMSG_HEADER.size)[0] == -errno.ENOENT


def loopback_uid(peer: tuple[str, int], ours: tuple[str, int]) -> int | None:
    """The uid owning the client socket of the loopback connection `peer` -> `ours`, or None when the
    kernel has no such live socket (the peer is gone) or cannot be asked."""
    if not uid_lookup_available():
        return None
    client = (_plain(ipaddress.ip_address(peer[0])), peer[1])
    server = (_plain(ipaddress.ip_address(ours[0])), ours[1])
    try:
        kind, answer = _ask_kernel(client, server)
    except OSError:
        return None
    if kind != _SOCK_DIAG_BY_FAMILY or answer[_DIAG_STATE_OFFSET] == _TCP_TIME_WAIT:
        return None
    return int(struct.unpack_from("=I", answer, _DIAG_UID_OFFSET)[0])


def identify(sock_peer: tuple[str, int] | None, sock_ours: tuple[str, int] | None) -> Peer | None:
    """The peer of a TCP connection from its two socket names (None for a socket that is not TCP/IP)."""
    if not sock_peer or not sock_ours:
        return None
    host = sock_peer[0]
    try:
        address = _plain(ipaddress.ip_address(host.split("%")[0]))
    except ValueError:
        return None
    if not address.is_loopback:
        return Peer(str(address), False, None)
    uid = loopback_uid((str(address), sock_peer[1]), (sock_ours[0].split("%")[0], sock_ours[1]))
    return Peer(str(address), True, uid)
