"""The one way an engine process starts: `engine_main(config, on_serving)`, called by the `tinkerrpc engine`
command, `serve`'s engine child (local/engine_child.py) and the bench's gather-then-run baseline.

Light imports only until its cheap checks have passed: a data dir another process owns or a port it
cannot listen on is one line before torch is imported.
"""

from __future__ import annotations

import sys
from collections.abc import Callable

from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.processes.http_serving import bound_port, listen
from tinkerrpc_server.processes.ownership import own_data_dir
from tinkerrpc_server.settings import forget_engine_api_key

PROGRAM = "tinkerrpc engine"


def _cannot_start(problem: object) -> int:
    print(f"{PROGRAM}: cannot start: {problem}", file=sys.stderr)
    return 1


def engine_main(config: EngineConfig, on_serving: Callable[[int], None] | None = None) -> int:
    """Serve the engine `config` describes until SIGTERM/SIGINT; its exit code. `on_serving(port)` runs
    once it answers requests, with the port it listens on. It does not start (exit code 1, one line on
    stderr) when another process owns the data dir, the port cannot be listened on, or this machine
    lacks the device or dtype asked for."""
    # Read into `config` already: nothing the engine starts inherits it.
    forget_engine_api_key()
    problem = own_data_dir(config.data_dir, patience=config.ownership_patience)
    if problem is not None:
        return _cannot_start(problem)
    try:
        sock = listen(config.host, config.port)
    except OSError as err:
        return _cannot_start(f"cannot listen on {config.host}:{config.port}: {err.strerror or err}")
    # After the cheap checks: these import torch.
    from tinkerrpc_server.engine.app import serve_engine
    from tinkerrpc_server.engine.runtime import PlacementError, resolve_placement

    try:
        # Here, not when the first model loads: whoever started the engine sees the exit at once.
        resolve_placement(config.device, config.dtype)
    except PlacementError as error:
        sock.close()
        return _cannot_start(error)

    def serving() -> None:
        if on_serving is not None:
            on_serving(bound_port(sock))

    serve_engine(sock, config, serving)
    return 0
