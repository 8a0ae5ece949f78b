"""Figure: a long run stays flat. One model on `tinkerrpc serve` (embedded engine, default retention, a full
state every step) trains 500 supervised steps; the engine's disk (checkpoints and their index) and the
step time at the end are compared with those at step 50 (short mode: 40 vs 20, which checks the harness
only). Ratios within one run, so the machine cancels out. The server's SQLite is reported beside: it keeps
each step's metrics and idempotency record by design (the run history), a few hundred bytes a step."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import tinkerrpc
from bench.report import Figure
from bench.workload import Settings
from tinkerrpc_server.local.stack import LocalStack

DISK_GOAL = 1.2
STEP_TIME_GOAL = 1.5
# Steps whose median is the step time at a point: the last WINDOW before it.
WINDOW = 20


def _disk(directory: Path) -> int:
    return sum(os.path.getsize(Path(root) / f) for root, _, files in os.walk(directory) for f in files)


def _sqlite_bytes(data_dir: Path) -> int:
    return sum(path.stat().st_size for path in data_dir.glob("*.sqlite3*"))


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    early, late = (20, 40) if settings.mode == "short" else (50, 500)
    data_dir = work_dir / "retention-data"
    stack = LocalStack(data_dir, work_dir / "retention-serve.log", ("--model-dir", str(model_dir)), 240.0)
    times: list[float] = []
    with stack, tinkerrpc.Client(stack.target) as client:
        model = client.create_model("long-run", base_model="tinkerrpc/tiny-chat", lora_rank=1)
        example = [tinkerrpc.Message.user("respond with yes"), tinkerrpc.Message.assistant("yes")]
        for step in range(1, late + 1):
            started = time.perf_counter()
            model.train_supervised([example], learning_rate=1e-3)
            times.append(time.perf_counter() - started)
            if step == early:
                disk_early, sqlite_early = _disk(data_dir / "engine"), _sqlite_bytes(data_dir)
        disk_late, sqlite_late = _disk(data_dir / "engine"), _sqlite_bytes(data_dir)
    time_early = statistics.median(times[early - WINDOW : early])
    time_late = statistics.median(times[late - WINDOW : late])
    policy = "default retention (16 sampler versions, 4 automatic state checkpoints), LoRA rank 1"
    return [
        Figure(
            name="retention: disk late in a run vs early",
            ours=disk_late / 2**20,
            baseline=disk_early / 2**20,
            unit="MiB",
            goal=DISK_GOAL,
            direction="<=",
            detail=(
                f"bytes of the engine's files (checkpoints, index) after step {late} vs {early}, {policy}; "
                f"the server's SQLite (with its WAL) was {sqlite_late / 2**20:.2f} vs {sqlite_early / 2**20:.2f} MiB"
            ),
        ),
        Figure(
            name="retention: step time late in a run vs early",
            ours=time_late * 1000,
            baseline=time_early * 1000,
            unit="ms",
            goal=STEP_TIME_GOAL,
            direction="<=",
            detail=f"median Train latency of the {WINDOW} steps up to step {late} vs up to {early}, {policy}",
        ),
    ]
