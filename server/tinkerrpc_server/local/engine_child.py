"""Entry point of the embedded engine child: `python -m tinkerrpc_server.local.engine_child PARENT_PID
engine ...`. It asks the kernel to SIGKILL it when the server dies (even by SIGKILL), then runs the CLI.

Set here rather than in a preexec_fn: a preexec_fn forces a plain fork() that runs Python and gRPC's
fork handlers in the child, which abort it when the server forks while gRPC threads are busy (an engine
restart). Without one the child is spawned by vfork and runs no code before exec.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys

_PR_SET_PDEATHSIG = 1


def main(argv: list[str]) -> int:
    parent_pid = int(argv[0])
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    if os.getppid() != parent_pid:
        return 1  # the server died before the signal was armed
    from tinkerrpc_server.cli import main as cli_main

    return cli_main(argv[1:])


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
