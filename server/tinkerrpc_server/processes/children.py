"""Child processes that say when they are ready, and whose exit the parent awaits.

The parent opens a pipe and hands its write end to the child (`--report-fd N` appended to the child's
command line). The child binds its ports itself (port 0: the kernel picks a free one, so no other
process can take it between a choice and a bind) and, once it serves, writes one JSON line there
naming them (`report_ready`). Only the child holds that pipe, so the line is the child's own word;
when the child dies first, the pipe closes and the parent learns it at once. A thread blocks in
wait() for the child's exit, so stopping and supervising wait on that exit instead of polling it.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import select
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import IO

log = logging.getLogger("tinkerrpc.processes")

REPORT_FD_FLAG = "--report-fd"
# Seconds the parent waits for a child that closed its report pipe to finish exiting.
_EXIT_AFTER_EOF_SECONDS = 10.0
_KILL_REAP_SECONDS = 30.0
_MAX_REPORT_BYTES = 4096


class StartError(RuntimeError):
    """A child exited (`exit_code` set) or did not report ready in time (`exit_code` None)."""

    def __init__(self, message: str, exit_code: int | None) -> None:
        super().__init__(message)
        self.exit_code = exit_code


def report_ready(fd: int, ports: Mapping[str, int]) -> None:
    """In the child: tell the parent it serves on `ports` (one JSON line on the report pipe), then close
    the pipe so nothing this process starts later holds it."""
    try:
        os.write(fd, json.dumps(dict(ports)).encode() + b"\n")
    finally:
        os.close(fd)


class ChildProcess:
    """`command` (with `--report-fd N` appended) as a child process, its output to `output` (inherited
    when None). `wait_ready` returns the ports it reported; `stop` sends SIGTERM, then SIGKILL."""

    def __init__(
        self,
        command: Sequence[str],
        env: Mapping[str, str],
        name: str,
        output: IO[bytes] | None = None,
    ) -> None:
        self.name = name
        read_fd, write_fd = os.pipe()  # neither end is inherited by other children (PEP 446)
        try:
            # No preexec_fn: it would force a plain fork() running Python's and gRPC's fork handlers.
            self._process = subprocess.Popen(
                [*command, REPORT_FD_FLAG, str(write_fd)],
                env=dict(env),
                stdout=output,
                stderr=subprocess.STDOUT if output is not None else None,
                pass_fds=(write_fd,),
            )
        except BaseException:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        self._report_fd: int | None = read_fd
        self._exited = threading.Event()
        self._exit_lock = threading.Lock()
        self._on_exit: list[Callable[[int], None]] = []
        threading.Thread(target=self._await_exit, name=f"wait-{name}", daemon=True).start()

    @property
    def pid(self) -> int:
        return self._process.pid

    def exit_code(self) -> int | None:
        """The child's exit code once it has exited (negative: killed by that signal), else None."""
        return self._process.returncode if self._exited.is_set() else None

    def _await_exit(self) -> None:
        code = self._process.wait()
        with self._exit_lock:
            self._exited.set()
            callbacks, self._on_exit = self._on_exit, []
        for callback in callbacks:
            callback(code)

    def wait_exit(self, timeout: float | None = None) -> int | None:
        """Block until the child exits; its exit code, or None after `timeout` seconds."""
        return self._process.returncode if self._exited.wait(timeout) else None

    async def exited(self) -> int:
        """The child's exit code, once it exits."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[int] = loop.create_future()

        def resolve(code: int) -> None:
            if not future.done():
                future.set_result(code)

        def on_exit(code: int) -> None:
            # The loop may have closed since a cancelled waiter left (a server stops its engine last).
            with contextlib.suppress(RuntimeError):
                loop.call_soon_threadsafe(resolve, code)

        with self._exit_lock:
            if self._exited.is_set():
                return self._process.returncode
            self._on_exit.append(on_exit)
        try:
            return await future
        finally:
            with self._exit_lock:
                if on_exit in self._on_exit:
                    self._on_exit.remove(on_exit)

    def wait_ready(self, timeout: float) -> dict[str, int]:
        """The ports the child reported once it serves. Raises StartError when it exits first or
        `timeout` seconds pass (the child keeps running then: stop it)."""
        fd = self._report_fd
        if fd is None:
            raise RuntimeError(f"{self.name}: readiness was already awaited")
        self._report_fd = None
        try:
            line = self._read_line(fd, time.monotonic() + timeout, timeout)
        finally:
            os.close(fd)
        return self._parse_report(line)

    async def ready(self, timeout: float) -> dict[str, int]:
        """wait_ready on a worker thread."""
        return await asyncio.to_thread(self.wait_ready, timeout)

    def _read_line(self, fd: int, deadline: float, timeout: float) -> bytes:
        received = b""
        while b"\n" not in received:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                raise StartError(f"{self.name} not ready after {timeout:.0f} s", None)
            readable, _, _ = select.select([fd], [], [], remaining)
            if not readable:
                continue
            chunk = os.read(fd, _MAX_REPORT_BYTES)
            if not chunk:
                code = self.wait_exit(_EXIT_AFTER_EOF_SECONDS)
                if code is None:
                    raise StartError(f"{self.name} closed its report pipe without reporting", None)
                raise StartError(f"{self.name} exited with code {code} before it was ready", code)
            received += chunk
            if len(received) > _MAX_REPORT_BYTES:
                break
        return received.split(b"\n", 1)[0]

    def _parse_report(self, line: bytes) -> dict[str, int]:
        try:
            report = json.loads(line)
        except ValueError:
            report = None
        if not isinstance(report, dict) or not all(
            isinstance(key, str) and type(port) is int and 0 < port < 65536 for key, port in report.items()
        ):
            raise StartError(f"{self.name} reported {line[:200]!r}, not its ports", None)
        return report

    def stop(self, grace: float) -> int:
        """SIGTERM the child, SIGKILL it if it outlives `grace` seconds; its exit code."""
        if not self._exited.is_set():
            self._process.send_signal(signal.SIGTERM)
            if not self._exited.wait(grace):
                log.warning(
                    "%s (pid %d) did not stop %.0f s after SIGTERM; killing it", self.name, self.pid, grace
                )
                self.kill()
        return self._process.returncode

    def kill(self) -> int:
        """SIGKILL the child and reap it; its exit code."""
        self._process.send_signal(signal.SIGKILL)
        if not self._exited.wait(_KILL_REAP_SECONDS):
            raise RuntimeError(f"{self.name} (pid {self.pid}) outlived SIGKILL")
        return self._process.returncode
