"""Starting a tinkerrpc process and knowing when it serves: `LocalProcess` runs a command as a child
that binds its own ports and reports them once it serves (processes.children), and `EngineProcess` is
the one way an engine process starts, with a fresh API key in its environment; `EmbeddedEngine` is
`serve`'s engine child, restarted through the server's backend when it dies.

Light imports only: the CLI starts the engine child before it imports the heavy service modules
(tinker, torch), so both boot in parallel.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import TypeVar

from tinkerrpc_server.engine.auth import generate_api_key
from tinkerrpc_server.processes.children import ChildProcess, StartError
from tinkerrpc_server.processes.ownership import probe_data_dir
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV, child_environment

ProcessT = TypeVar("ProcessT", bound="LocalProcess")

log = logging.getLogger("tinkerrpc.local")

ENGINE_STARTUP_TIMEOUT = 180.0
# Seconds a stopping engine child gets between SIGTERM and SIGKILL.
_ENGINE_STOP_GRACE = 5.0
_LOG_TAIL_CHARS = 3000


def tinkerrpc_command(*args: str) -> list[str]:
    """The `tinkerrpc` command line run with this interpreter (the console script may not be on PATH)."""
    return [sys.executable, "-m", "tinkerrpc_server.cli", *args]


class LocalProcess:
    """`cmd` as a child process, its output appended to `log_path` (inherited when None), its environment
    `env` (this process's without credentials, plus what is handed to it: see settings).

    `start()` (or entering the context) returns once the process reported the ports it serves on, and
    raises with the log's tail when it exits first or `startup_timeout` passes. `stop()` (or leaving)
    sends SIGTERM, then SIGKILL if the process outlives `stop_timeout`.
    """

    def __init__(
        self,
        cmd: Sequence[str],
        name: str,
        log_path: Path | None,
        startup_timeout: float,
        env: Mapping[str, str] | None = None,
    ) -> None:
        self.cmd = list(cmd)
        self.name = name
        self.env = child_environment(env)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self._child: ChildProcess | None = None
        self._ports: dict[str, int] = {}

    @property
    def child(self) -> ChildProcess:
        if self._child is None:
            raise RuntimeError(f"`{self.name}` has not started")
        return self._child

    def reported(self, name: str) -> int:
        """The port `name` the process reported once it served."""
        if name not in self._ports:
            raise RuntimeError(f"`{self.name}` has not reported a {name} (start it first)")
        return self._ports[name]

    @property
    def port(self) -> int:
        return self.reported("port")

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def pid(self) -> int:
        return self.child.pid

    def log(self) -> str:
        return self.log_path.read_text(errors="replace") if self.log_path is not None else ""

    def launch(self) -> ChildProcess:
        """Start the process without waiting for it to serve."""
        if self._child is not None and self._child.exit_code() is None:
            # A second process would replace the first, which then outlives every stop().
            raise RuntimeError(f"`{self.name}` was already started (enter the unstarted object)")
        self._ports = {}
        if self.log_path is None:
            self._child = ChildProcess(self.cmd, self.env, self.name)
        else:
            self.log_path.parent.mkdir(parents=True, exist_ok=True)
            with open(self.log_path, "ab") as output:
                self._child = ChildProcess(self.cmd, self.env, self.name, output)
        return self._child

    def start(self: ProcessT) -> ProcessT:
        child = self.launch()
        try:
            self.served(child.wait_ready(self.startup_timeout))
        except StartError as err:
            self.stop()
            where = f"; see {self.log_path}" if self.log_path is not None else ""
            if err.exit_code is None:
                raise TimeoutError(f"`{self.name}` not ready: {err}{where}") from None
            raise RuntimeError(
                f"`{self.name}` exited with {err.exit_code}{where}:\n{self.log()[-_LOG_TAIL_CHARS:]}"
            ) from None
        except BaseException:
            self.stop()
            raise
        return self

    def served(self, ports: dict[str, int]) -> None:
        """Keep the ports the process reported once it served; a subclass may check them further."""
        self._ports = ports

    def stop(self, stop_timeout: float = 60.0) -> int | None:
        """Stop the process; its exit code (None if it never started)."""
        if self._child is None:
            return None
        return self._child.stop(stop_timeout)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit by itself; its exit code."""
        code = self.child.wait_exit(timeout)
        if code is None:
            raise TimeoutError(f"`{self.name}` still runs after {timeout} s")
        return code

    def kill(self) -> int:
        """SIGKILL the process (a crash, for fault tests) and reap it; its exit code."""
        return self.child.kill()

    def __enter__(self: ProcessT) -> ProcessT:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class EngineProcess(LocalProcess):
    """An engine process on 127.0.0.1 (a port it picks), requiring `api_key`, fresh for each start and
    handed over in its environment (never argv, which every user of the machine can read)."""

    def __init__(self, cmd: Sequence[str], name: str, log_path: Path | None, startup_timeout: float) -> None:
        self.api_key = generate_api_key()
        super().__init__(cmd, name, log_path, startup_timeout, {ENGINE_API_KEY_ENV: self.api_key})


def engine_child_command(data_dir: Path, model_dir: Path) -> list[str]:
    return [
        sys.executable,
        "-m",
        "tinkerrpc_server.local.engine_child",
        "--parent-pid",
        str(os.getpid()),
        "--host",
        "127.0.0.1",
        "--data-dir",
        str(data_dir),
        "--model-dir",
        str(model_dir),
    ]


class EmbeddedEngine(EngineProcess):
    """`serve`'s engine child, its output the server's. Starts at once (it boots while the server imports
    its service modules); the server's backend awaits `wait_ready`, awaits `exited` to learn of its
    death, and calls `restart` then (a new process, port and key on the same data dir)."""

    def __init__(
        self, data_dir: Path, model_dir: Path, startup_timeout: float = ENGINE_STARTUP_TIMEOUT
    ) -> None:
        super().__init__(engine_child_command(data_dir, model_dir), "embedded engine", None, startup_timeout)
        # A data dir the engine cannot write is reported by wait_ready (the server probes its own first
        # and stops with one line); the child is not started then.
        self.start_error = probe_data_dir(data_dir)
        if self.start_error is None:
            self._start()

    def _start(self) -> None:
        # Started from the main thread on purpose: the child's PDEATHSIG fires when the forking *thread* exits.
        child = self.launch()
        log.info("embedded engine starting (pid %d)", child.pid)

    @property
    def url(self) -> str:
        return self.base_url

    def exit_code(self) -> int | None:
        return self._child.exit_code() if self._child is not None else None

    async def wait_ready(self) -> None:
        if self._child is None:
            raise StartError(self.start_error or "embedded engine not started", None)
        try:
            self.served(await self._child.ready(self.startup_timeout))
        except StartError:
            self.stop()
            raise
        log.info("embedded engine healthy on %s", self.url)

    async def exited(self) -> int:
        return await self.child.exited()

    def stop(self, stop_timeout: float = _ENGINE_STOP_GRACE) -> int | None:
        return super().stop(stop_timeout)

    async def restart(self) -> None:
        """Stop the child if it still runs, start a new one with a new key, and wait until it serves."""
        self.stop()
        self.api_key = generate_api_key()
        self.env[ENGINE_API_KEY_ENV] = self.api_key
        self._start()
        await self.wait_ready()
