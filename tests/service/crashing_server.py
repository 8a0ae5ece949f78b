"""The real `tinkerrpc serve` (embedded engine included), built with a step hook that kills the process
the way SIGKILL would (os._exit(137)) when a Train step reaches the named point. The restart-recovery
tests run it as `python -m crashing_server serve --host H --port P --data-dir D --model-dir M
--crash-at POINT` with this directory on PYTHONPATH (svc.Server(..., crash_at=POINT) does that)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, get_args

if TYPE_CHECKING:
    from tinkerrpc_server.service.training import StepPoint

log = logging.getLogger("tinkerrpc.test.crash")


class CrashAt:
    def __init__(self, point: StepPoint) -> None:
        self.point = point

    def reached(self, point: StepPoint) -> None:
        if point == self.point:
            log.warning("Train step reached %s: exiting now", point)
            os._exit(137)


def main() -> int:
    # As `tinkerrpc serve` does, before torch loads (the imports below): see tinkerrpc_server.cli.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from tinkerrpc_server.local.engine_process import EmbeddedEngine
    from tinkerrpc_server.server import ServerConfig, serve
    from tinkerrpc_server.service.training import StepPoint

    parser = argparse.ArgumentParser(prog="crashing_server")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--crash-at", choices=get_args(StepPoint), required=True)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        model_dir=args.model_dir,
        step_hooks=CrashAt(args.crash_at),
    )
    engine = EmbeddedEngine(args.data_dir / "engine", args.model_dir)
    try:
        return asyncio.run(serve(config, engine))
    finally:
        engine.stop()


if __name__ == "__main__":
    sys.exit(main())
