"""The engine's compute thread is the only one that runs torch's parallel ops (engine/worker.py): work
run `in_passing_thread` leaves no OpenMP team behind, and the compute thread uses the thread count it is
given whatever the process-wide count is. Each check runs in a fresh interpreter, whose thread counts and
torch settings are its own."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

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
