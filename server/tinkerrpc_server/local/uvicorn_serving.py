"""The one way a tinkerrpc HTTP server (the engine, the sidecar) runs under uvicorn and stops.

uvicorn's own signal handling re-raises SIGTERM once it has shut down, so a process would die by the
signal instead of exiting 0, and it replaces the handlers of a process that hosts it next to other
servers. Here the caller's event loop owns the signals: either this module installs them for a whole
process (`serve_until_signalled`), or the host sets an event (`serve_until_stopped`).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
from collections.abc import Iterator

import uvicorn


class _LoopOwnsSignals(uvicorn.Server):
    """A uvicorn server that neither installs signal handlers nor re-raises a signal at the end."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


def serve_until_signalled(config: uvicorn.Config) -> None:
    """Serve as the whole process until SIGTERM or SIGINT, then return after the graceful shutdown, so
    the process exits 0. A second SIGINT stops waiting for open connections, as in uvicorn."""
    server = _LoopOwnsSignals(config)

    async def serve() -> None:
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, server.handle_exit, sig, None)
        await server.serve()

    asyncio.run(serve())


async def serve_until_stopped(config: uvicorn.Config, stop: asyncio.Event) -> None:
    """Serve on the running loop, whose owner handles the signals, until `stop` is set; then shut down
    gracefully."""
    server = _LoopOwnsSignals(config)
    serving = asyncio.create_task(server.serve())
    stopping = asyncio.create_task(stop.wait())
    await asyncio.wait({serving, stopping}, return_when=asyncio.FIRST_COMPLETED)
    server.should_exit = True
    stopping.cancel()
    await serving
