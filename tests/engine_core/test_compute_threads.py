"""The engine's compute thread is the only one that runs torch's parallel ops (engine/worker.py): work
run `in_passing_thread` leaves no OpenMP team behind, and the compute thread uses the thread count it is
given whatever the process-wide count is. Each check runs in a fresh interpreter, whose thread counts and
torch settings are its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tinkerrpc_server.model_store import TINY_CHAT, resolve_base_model

pytestmark = pytest.mark.process


def run_fresh(script: str) -> list[str]:
    completed = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)], capture_output=True, text=True, timeout=120
    )
    assert completed.returncode == 0, completed.stderr
    return completed.stdout.split()


def test_work_in_a_passing_thread_leaves_no_openmp_team_behind() -> None:
    """A thread that runs a parallel op keeps an OpenMP team (a worker thread per extra torch thread)
    until it ends: on the main thread it stays for the process's life, on a passing thread it goes."""
    base, after_passing, after_main = map(
        int,
        run_fresh(
            """
            import os, time, torch
            from tinkerrpc_server.engine.worker import in_passing_thread

            torch.set_num_threads(2)
            big = torch.randn(1 << 22)

            def threads():
                return len(os.listdir("/proc/self/task"))

            base = threads()
            assert in_passing_thread(lambda: int((big > 10).sum())) == 0
            deadline = time.monotonic() + 10
            while threads() != base and time.monotonic() < deadline:
                time.sleep(0.05)
            after_passing = threads()
            (big * 2).sum()
            print(base, after_passing, threads())
            """
        ),
    )
    assert after_passing == base
    assert after_main == base + 1  # the main thread's team: what the passing thread spares the engine


def test_the_compute_thread_uses_its_own_torch_thread_count() -> None:
    """The engine's main thread keeps one torch thread; the compute thread runs with the count it was
    given (without it, it would take the process-wide one, 1 here)."""
    on_worker, on_main = run_fresh(
        """
        import torch
        from tinkerrpc_server.engine.futures import FailedResult, RequestFuture
        from tinkerrpc_server.engine.worker import ComputeWorker

        torch.set_num_threads(1)
        torch.get_num_threads()
        worker = ComputeWorker(lambda exc: FailedResult(str(exc), "internal"), torch_threads=2)
        future = RequestFuture()
        count = lambda: FailedResult(str(torch.get_num_threads()), "user")
        worker.submit_training("m", None, "count", count, future)
        print(future.result(timeout=60).message, torch.get_num_threads())
        worker.stop()
        """
    )
    assert (on_worker, on_main) == ("2", "1")


def test_the_engine_prepares_its_process_without_an_openmp_team_on_its_main_thread(tmp_path: Path) -> None:
    """Preparing the engine's process (the built-in models laid out, the execution plan chosen, which
    times kernels with parallel ops) leaves no OpenMP worker behind: one would make the compute thread's
    team sleep between a decode step's ops (SmolLM2's one-row decode ran at 33 steps/s through the engine
    instead of 42)."""
    models = tmp_path / "models"
    resolve_base_model(TINY_CHAT, models)  # built here: building it starts the tokenizer's own threads
    before, after, torch_threads = map(
        int,
        run_fresh(
            f"""
            import os, time, torch
            from pathlib import Path
            from tinkerrpc_server.engine.app import prepare_engine_process
            from tinkerrpc_server.engine.config import EngineConfig

            torch.set_num_threads(2)

            def threads():
                return len(os.listdir("/proc/self/task"))

            before = threads()
            config = EngineConfig(Path({str(tmp_path / "data")!r}), Path({str(models)!r}), insecure_no_auth=True)
            config = prepare_engine_process(config)
            deadline = time.monotonic() + 10
            while threads() != before and time.monotonic() < deadline:
                time.sleep(0.05)
            print(before, threads(), config.torch_threads)
            """
        ),
    )
    assert torch_threads == 2  # what the compute thread will run with
    assert after == before  # with the plan chosen on the main thread: before + 1, its team's worker
