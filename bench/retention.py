"""Figure: a long run stays flat. One model on `tinkerrpc serve` (embedded engine, default retention, a full
state every step) trains 500 supervised steps. Disk: the engine's files (checkpoints and their index) at
the end vs at step 50. Step time: the run's last steps vs the first steps of a fresh run (a second server
on a new data dir, started near the end), the two runs' steps alternating, so both sides are measured in
the same minute: the machine's speed drifts by ±30% over minutes, which swamped a comparison of steps
taken minutes apart. Restores: on the fresh server, the step time after RESTORES restores of a named
state checkpoint vs just before them (each restore replaces the training client; a client left loaded
would make every later step dearer). Short mode (40 steps, 20 of them alternating, 5 restores) checks the
harness only. The server's SQLite is reported beside: it keeps each step's metrics and idempotency
record by design (the run history), a few hundred bytes a step."""

from __future__ import annotations

import os
import statistics
import time
from pathlib import Path

import tinkerrpc
from bench.report import Figure, rounds
from bench.workload import Settings
from tinkerrpc_server.local.stack import LocalStack

DISK_GOAL = 1.2
STEP_TIME_GOAL = 1.5
# Steps whose median is a run's step time: the long run's last WINDOW, the fresh run's WINDOW after
# its first FRESH_WARMUP (its compile and allocation steps), all taken alternating with each other.
WINDOW = 20
FRESH_WARMUP = {"full": 30, "short": 0}
RESTORES = {"full": 50, "short": 5}
_EXAMPLE = [tinkerrpc.Message.user("respond with yes"), tinkerrpc.Message.assistant("yes")]


def _disk(directory: Path) -> int:
    # The engine prunes old versions while the run goes on: a file listed a moment ago may be gone.
    total = 0
    for root, _, files in os.walk(directory):
        for name in files:
            try:
                total += os.path.getsize(Path(root) / name)
            except FileNotFoundError:
                continue
    return total


def _sqlite_bytes(data_dir: Path) -> int:
    return sum(path.stat().st_size for path in data_dir.glob("*.sqlite3*"))


def _timed_step(model: tinkerrpc.Model) -> float:
    started = time.perf_counter()
    model.train_supervised([_EXAMPLE], learning_rate=1e-3)
    return time.perf_counter() - started


def _stack(work_dir: Path, name: str, model_dir: Path) -> LocalStack:
    return LocalStack(
        work_dir / f"{name}-data", work_dir / f"{name}-serve.log", ("--model-dir", str(model_dir)), 240.0
    )


def _model(client: tinkerrpc.Client) -> tinkerrpc.Model:
    return client.create_model("long-run", base_model="tinkerrpc/tiny-chat", lora_rank=1)


def _step_time(
    comparison: str, ours_seconds: list[float], baseline_seconds: list[float], detail: str
) -> Figure:
    """The median of each side's steps, in ms; a round is a step of each, in the order taken."""
    ours_ms = [seconds * 1000 for seconds in ours_seconds]
    baseline_ms = [seconds * 1000 for seconds in baseline_seconds]
    return Figure(
        name=f"retention: step time {comparison}",
        ours=statistics.median(ours_ms),
        baseline=statistics.median(baseline_ms),
        unit="ms",
        goal=STEP_TIME_GOAL,
        direction="<=",
        rounds=rounds(ours_ms, baseline_ms),
        detail=detail,
    )


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    early, late = (20, 40) if settings.mode == "short" else (50, 500)
    warmup = FRESH_WARMUP[settings.mode]
    alternating = warmup + WINDOW
    long_stack = _stack(work_dir, "retention", model_dir)
    data_dir = long_stack.data_dir
    late_times: list[float] = []
    fresh_times: list[float] = []
    with long_stack, tinkerrpc.Client(long_stack.target) as client:
        model = _model(client)
        for step in range(1, late - alternating + 1):
            model.train_supervised([_EXAMPLE], learning_rate=1e-3)
            if step == early:
                disk_early, sqlite_early = _disk(data_dir / "engine"), _sqlite_bytes(data_dir)
        with (
            _stack(work_dir, "retention-fresh", model_dir) as fresh_stack,
            tinkerrpc.Client(fresh_stack.target) as fresh_client,
        ):
            fresh_model = _model(fresh_client)
            for _ in range(alternating):
                late_times.append(_timed_step(model))
                fresh_times.append(_timed_step(fresh_model))
            fresh_model.save_checkpoint("base")
            before_restores = [_timed_step(fresh_model) for _ in range(WINDOW)]
            for _ in range(RESTORES[settings.mode]):
                fresh_model.restore("base")
            after_restores = [_timed_step(fresh_model) for _ in range(WINDOW)]
        disk_late, sqlite_late = _disk(data_dir / "engine"), _sqlite_bytes(data_dir)
    policy = "default retention (16 sampler versions, 4 automatic state checkpoints), LoRA rank 1"
    return [
        Figure(
            name="retention: disk late in a run vs early",
            ours=disk_late / 2**20,
            baseline=disk_early / 2**20,
            unit="MiB",
            goal=DISK_GOAL,
            direction="<=",
            rounds=rounds([disk_late / 2**20], [disk_early / 2**20]),
            detail=(
                f"bytes of the engine's files (checkpoints, index) after step {late} vs {early}, {policy}; "
                f"the server's SQLite (with its WAL) was {sqlite_late / 2**20:.2f} vs {sqlite_early / 2**20:.2f} MiB"
            ),
        ),
        _step_time(
            "late in a run vs early",
            late_times[-WINDOW:],
            fresh_times[-WINDOW:],
            f"median Train latency of steps {late - WINDOW + 1}-{late} of the run vs steps "
            f"{warmup + 1}-{warmup + WINDOW} of a fresh run (its own server and data dir), one step of "
            f"each in turn; {policy}",
        ),
        _step_time(
            "after restores vs before",
            after_restores,
            before_restores,
            f"median Train latency of {WINDOW} steps after {RESTORES[settings.mode]} RestoreCheckpoint "
            f"calls vs {WINDOW} steps just before them, on the fresh run's model; {policy}",
        ),
    ]
