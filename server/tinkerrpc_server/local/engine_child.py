"""Entry point of the embedded engine child, started by `EmbeddedEngine`:
`python -m tinkerrpc_server.local.engine_child --parent-pid PID --host H --data-dir D --model-dir M
--report-fd N`, with the API key its clients must send in $TINKERRPC_ENGINE_API_KEY (argv is readable by
every user). It binds a port of its own (`--port`, 0 by default: one the kernel picks) and reports it
on the inherited descriptor N once it serves.

It asks the kernel to SIGKILL it when the server dies (even by SIGKILL), then runs the engine
(engine.main.engine_main, as `tinkerrpc engine` does).

Set here rather than in a preexec_fn: a preexec_fn forces a plain fork() that runs Python and gRPC's
fork handlers in the child, which abort it when the server forks while gRPC threads are busy (an engine
restart). Without one the child is spawned by vfork and runs no code before exec.

The engine's device and base-weight dtype come from the settings (settings.py) it inherits from the
server's environment; one this machine lacks stops the child at once.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys
from pathlib import Path

from tinkerrpc_server.engine.config import EngineConfig, EngineConfigError
from tinkerrpc_server.engine.main import engine_main
from tinkerrpc_server.processes.children import REPORT_FD_FLAG, report_ready
from tinkerrpc_server.settings import configure_logging, set_process_defaults, settings_of

_PR_SET_PDEATHSIG = 1
# A standalone engine may own the data dir. Patience: the child of a server killed just before this one
# started may still be exiting (a large model takes seconds to unmap), lock still held.
_PREDECESSOR_EXIT_SECONDS = 15.0


def _parse(argv: list[str]) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="tinkerrpc_server.local.engine_child")
    parser.add_argument("--parent-pid", type=int, required=True)
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument(REPORT_FD_FLAG, type=int, default=None)
    return parser.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    settings = settings_of("tinkerrpc engine")
    if settings is None:
        return 2
    try:
        config = EngineConfig.from_settings(
            settings,
            args.data_dir,
            args.model_dir,
            host=args.host,
            port=args.port,
            ownership_patience=_PREDECESSOR_EXIT_SECONDS,
        )
    except EngineConfigError as err:
        print(f"tinkerrpc engine: {err}", file=sys.stderr)
        return 2
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != args.parent_pid:
        return 1  # the server died before the signal was armed
    set_process_defaults()
    configure_logging(settings.log_level)
    report_fd = args.report_fd

    def report(port: int) -> None:
        if report_fd is not None:
            report_ready(report_fd, {"port": port})

    return engine_main(config, report)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
