"""The real `tinkerrpc serve` (embedded engine included), built with a step hook that kills the process
the way SIGKILL would (os._exit(137)) when a Train step reaches the named point (the `--crash-after`th time
it does, 1 by default). The restart-recovery tests run it as `python -m crashing_server serve --host H
--port P --data-dir D --model-dir M --crash-at POINT` with this directory on PYTHONPATH
(svc.Server(..., crash_at=POINT) does that). With TINKER_API_KEY set it uses the Tinker at --tinker-url,
as `tinkerrpc serve` does, instead of an embedded engine child."""

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
    def __init__(self, point: StepPoint, times: int) -> None:
        self.point = point
        self.times = times

    def reached(self, point: StepPoint) -> None:
        if point == self.point:
            self.times -= 1
            if self.times == 0:
                log.warning("Train step reached %s: exiting now", point)
                os._exit(137)


def main() -> int:
    # As `tinkerrpc serve` does, before torch loads (the imports below): see tinkerrpc_server.cli.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    from tinkerrpc_server.service.torchless import hide_torch

    hide_torch()  # as `tinkerrpc serve` does: only the engine child computes
    from tinkerrpc_server.local.launch import EmbeddedEngine
    from tinkerrpc_server.server import ServerConfig, serve
    from tinkerrpc_server.service.training import StepPoint
    from tinkerrpc_server.settings import Settings

    parser = argparse.ArgumentParser(prog="crashing_server")
    parser.add_argument("command", choices=["serve"])
    parser.add_argument("--host", required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument("--crash-at", choices=get_args(StepPoint), required=True)
    parser.add_argument("--crash-after", type=int, default=1)
    parser.add_argument("--checkpoint-every", type=int)
    parser.add_argument("--tinker-url")
    parser.add_argument("--report-fd", type=int)
    args = parser.parse_args()
    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
    settings = Settings.from_environment()
    config = ServerConfig(
        host=args.host,
        port=args.port,
        data_dir=args.data_dir,
        model_dir=args.model_dir,
        checkpoint_every=args.checkpoint_every,
        tinker_api_key=settings.tinker_api_key,
        tinker_url=args.tinker_url or settings.tinker_base_url,
        step_hooks=CrashAt(args.crash_at, args.crash_after),
        report_fd=args.report_fd,
    )
    engine = None if settings.tinker_api_key else EmbeddedEngine(args.data_dir / "engine", args.model_dir)
    try:
        return asyncio.run(serve(config, engine))
    finally:
        if engine is not None:
            engine.stop()


if __name__ == "__main__":
    sys.exit(main())
