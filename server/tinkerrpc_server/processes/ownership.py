"""One owner per data dir and per port, and a data dir that can hold state. `serve` and `engine` lock their data dir for as long as they
run, and `serve` checks that its ports are free before it starts anything, so a second process
started on either exits at start with one line instead of sharing the state (or, through
SO_REUSEPORT, the calls) of the first. Light imports only: the CLI checks before the heavy ones."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import socket
import time
from pathlib import Path

LOCK_FILE_NAME = "tinkerrpc.lock"

# Bytes the data-dir probe writes: enough that a full file system fails the probe, not a later step.
_PROBE_BYTES = 64 * 1024

# Seconds a refused process waits for the holder to write its PID (it locks first, then writes).
_HOLDER_PID_WAIT = 1.0

# Lock files of the data dirs this process owns, open until it exits. The kernel releases a flock
# when the process holding it dies, however it dies, so a killed owner never leaves a stale lock.
_owned: dict[Path, int] = {}


def own_data_dir(directory: Path, patience: float = 0.0) -> str | None:
    """Why this process cannot own `directory`, or None once it does (also when it already did):
    an exclusive flock on its lock file, held until the process exits, with our PID written there
    for a refused process to name. A lock still held after `patience` seconds is refused."""
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        key = directory.resolve()
        if key in _owned:
            return None
        # Not truncated on open: until the lock is ours, the file holds the owner's PID.
        fd = os.open(directory / LOCK_FILE_NAME, os.O_RDWR | os.O_CREAT, 0o600)
    except OSError as err:
        return f"data dir {directory} is not writable: {err.strerror or err}"
    deadline = time.monotonic() + patience
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            break
        except BlockingIOError:
            if time.monotonic() < deadline:
                time.sleep(0.1)
                continue
            holder = _holder_pid(fd)
            os.close(fd)
            return f"data dir {directory} is in use by another tinkerrpc process (pid {holder})"
        except OSError as err:
            os.close(fd)
            return f"data dir {directory} cannot be locked: {err.strerror or err}"
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
    _owned[key] = fd
    return None


def _holder_pid(fd: int) -> str:
    deadline = time.monotonic() + _HOLDER_PID_WAIT
    while True:
        text = os.pread(fd, 32, 0).decode(errors="replace").strip()
        if text or time.monotonic() > deadline:
            return text or "unknown"
        time.sleep(0.05)


def port_taken(host: str, port: int) -> str | None:
    """Why `host:port` cannot be listened on because another process listens there, or None.
    Bound as gRPC and uvicorn bind (SO_REUSEADDR, no SO_REUSEPORT), so a port in TIME_WAIT is free;
    other bind errors are left to the server's own bind, which reports them."""
    try:
        addresses = socket.getaddrinfo(
            host.strip("[]"), port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
    except socket.gaierror:
        return None
    for family, kind, proto, _, address in addresses:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as err:
                if err.errno == errno.EADDRINUSE:
                    return f"port {port} on {host} is in use by another process"
    return None


def probe_data_dir(directory: Path) -> str | None:
    """Why `directory` cannot hold state, or None when it can: creates it, then writes, fsyncs and
    deletes a file there, so an unwritable or full disk is reported at start, not mid-step. A directory
    it creates is its owner's alone (0700)."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = os.write(fd, bytes(_PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as err:
        return f"data dir {directory} is not writable: {err.strerror or err}"
    if written < _PROBE_BYTES:
        return f"data dir {directory} is full: wrote {written} of {_PROBE_BYTES} probe bytes"
    return None
