"""The gather-then-run baseline that bench/sampling.py measures continuous batching against: the engine's
batching before continuous batching, as a strategy the engine is built with here, not a mode of it.

Jobs join only an empty batch, every row computes until the batch's last row stops, all are answered
then, and every row is prefilled on its own. `gather_then_run_engine` starts an engine so built:
`python -m bench.gather_then_run --data-dir D --model-dir M --report-fd FD`, with its clients' API key in
$TINKERRPC_ENGINE_API_KEY and its placement in $TINKERRPC_ENGINE_DEVICE/$TINKERRPC_ENGINE_DTYPE.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from tinkerrpc_server import settings
from tinkerrpc_server.engine.compute.scheduler import BatchPolicy
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.main import engine_main
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.processes.children import REPORT_FD_FLAG, report_ready

JobT = TypeVar("JobT")


class GatherThenRun:
    """A BatchingStrategy: nothing joins a running batch, stopped rows stay in it until all have
    stopped, and its jobs are answered when it drains."""

    def __init__(self) -> None:
        self._answers: list[Callable[[], None]] = []

    def admits_into_running_batch(self) -> bool:
        return False

    def rows_kept(self, live: list[int], rows: int) -> list[int]:
        return list(range(rows)) if live else []

    def finished(self, job: JobT, answer: Callable[[JobT], None]) -> None:
        self._answers.append(functools.partial(answer, job))

    def batch_drained(self) -> None:
        answers, self._answers = self._answers, []
        for answer in answers:
            answer()


GATHER_THEN_RUN = BatchPolicy(share_prompts=False, batching=GatherThenRun)


def gather_then_run_engine(data_dir: Path, model_dir: Path, log_path: Path) -> LocalEngine:
    """An unstarted engine batching as GATHER_THEN_RUN, on a port of 127.0.0.1 it binds and reports."""
    engine = LocalEngine(data_dir, model_dir, log_path)
    engine.cmd = [sys.executable, "-m", "bench.gather_then_run", "--data-dir", str(data_dir)]
    engine.cmd += ["--model-dir", str(model_dir)]
    return engine


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="bench.gather_then_run")
    parser.add_argument("--data-dir", type=Path, required=True)
    parser.add_argument("--model-dir", type=Path, required=True)
    parser.add_argument(REPORT_FD_FLAG, dest="report_fd", type=int, required=True)
    args = parser.parse_args(argv)
    environment = settings.Settings.from_environment()
    # As `tinkerrpc engine` starts: the baseline runs under the same process settings and start-up.
    settings.set_process_defaults()
    settings.configure_logging(environment.log_level)
    config = EngineConfig.from_settings(environment, args.data_dir, args.model_dir, policy=GATHER_THEN_RUN)
    return engine_main(config, lambda port: report_ready(args.report_fd, {"port": port}))


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
