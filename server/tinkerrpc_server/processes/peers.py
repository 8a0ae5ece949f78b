"""Who is on the other end of an accepted TCP connection, for admitting it before it holds a slot.

A peer on another machine is known by its address only. A peer on this machine (a loopback address) is
known by the uid that owns its socket, which the kernel lists in /proc/net/tcp and /proc/net/tcp6: the
client's end of our connection is the entry whose local address is the peer's and whose remote address
is ours. Where /proc does not list sockets (not Linux) the uid is unknown and `UID_LOOKUP_AVAILABLE` is
False.
"""

from __future__ import annotations

import ipaddress
import sys
from pathlib import Path
from typing import NamedTuple

_PROC_TCP = (Path("/proc/net/tcp"), Path("/proc/net/tcp6"))
UID_LOOKUP_AVAILABLE = _PROC_TCP[0].exists()
# /proc/net/tcp's state column; a TIME_WAIT entry no longer belongs to anyone (its uid reads 0).
_TIME_WAIT = "06"


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


def _plain(
    address: ipaddress.IPv4Address | ipaddress.IPv6Address,
) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An IPv4-mapped IPv6 address as the IPv4 address it carries (the kernel lists it in tcp, not tcp6)."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        return address.ipv4_mapped
    return address


def _proc_hex(address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int) -> str:
    """`address:port` as /proc/net/tcp* prints it: the address in 32-bit words of host byte order."""
    packed = address.packed
    words = (packed[i : i + 4] for i in range(0, len(packed), 4))
    hex_address = "".join(f"{int.from_bytes(word, sys.byteorder):08X}" for word in words)
    return f"{hex_address}:{port:04X}"


def loopback_uid(peer: tuple[str, int], ours: tuple[str, int]) -> int | None:
    """The uid owning the client socket of the loopback connection `peer` -> `ours`, or None when no
    listed socket matches (the peer is gone, or /proc lists no sockets here)."""
    peer_address, our_address = _plain(ipaddress.ip_address(peer[0])), _plain(ipaddress.ip_address(ours[0]))
    client_end = _proc_hex(peer_address, peer[1])
    server_end = _proc_hex(our_address, ours[1])
    table = _PROC_TCP[0] if peer_address.version == 4 else _PROC_TCP[1]
    try:
        lines = table.read_text().splitlines()[1:]
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        if (
            len(fields) > 7
            and fields[1] == client_end
            and fields[2] == server_end
            and fields[3] != _TIME_WAIT
        ):
            return int(fields[7])
    return None


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
