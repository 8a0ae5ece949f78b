"""Figure 6: peak RSS of the stack (`tinkerrpc serve` + its engine) while the demo runs through it, vs
one process doing the same kind of work in-process with transformers+PEFT (bench/memory_baseline.py)."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.report import Figure
from bench.workload import Settings
from tinkerrpc_server.demo import DemoConfig, run_demo

MEMORY_GOAL = 2.0
SAMPLE_SECONDS = 0.05


class PeakRss:
    """Samples the summed RSS of the processes `select()` names, every 50 ms, in a background thread."""

    def __init__(self, select: Callable[[], list[psutil.Process]]) -> None:
        self._select = select
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.processes_seen: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="rss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for proc in self._select():
                try:
                    total += proc.memory_info().rss
                    self.processes_seen.add(proc.pid)
                except psutil.Error:
                    pass  # exited between listing and reading
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> PeakRss:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


def _new_descendants(existing: set[int]) -> Callable[[], list[psutil.Process]]:
    me = psutil.Process()

    def select() -> list[psutil.Process]:
        try:
            return [p for p in me.children(recursive=True) if p.pid not in existing]
        except psutil.Error:
            return []

    return select


def _stack_peak(settings: Settings, work_dir: Path) -> tuple[int, int, float]:
    """(peak bytes, processes seen, seconds) of the stack the demo starts."""
    existing = {p.pid for p in psutil.Process().children(recursive=True)}
    config = DemoConfig(
        out_dir=work_dir / "demo",
        sft_max_steps=settings.demo_sft_max_steps,
        rl_max_steps=settings.demo_rl_max_steps,
        data_dir=work_dir / "demo-data",
    )
    failure: list[BaseException] = []

    def demo() -> None:
        try:
            run_demo(config)
        except BaseException as exc:  # re-raised in the measuring thread
            failure.append(exc)

    started = time.perf_counter()
    with PeakRss(_new_descendants(existing)) as sampler:
        runner = threading.Thread(target=demo, name="demo")
        runner.start()
        runner.join()
    if failure:
        raise failure[0]
    return sampler.peak_bytes, len(sampler.processes_seen), time.perf_counter() - started


def _baseline_peak(settings: Settings, model_dir: Path, log_path: Path) -> int:
    cmd = [
        sys.executable, "-m", "bench.memory_baseline", "--model-dir", str(model_dir),
        "--steps", str(min(settings.demo_sft_max_steps, 5)),
    ]  # fmt: skip
    with open(log_path, "ab") as log:
        proc = psutil.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=Path(__file__).parent.parent)
    with PeakRss(lambda: [proc]) as sampler:
        code = proc.wait(600)
    if code != 0:
        raise RuntimeError(f"memory baseline exited with {code}:\n{log_path.read_text()[-3000:]}")
    return sampler.peak_bytes


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    stack_bytes, processes, seconds = _stack_peak(settings, work_dir)
    baseline_bytes = _baseline_peak(settings, model_dir, work_dir / "memory_baseline.log")
    return [
        Figure(
            name="memory: peak RSS of server + engine in the demo",
            ours=stack_bytes / 2**20,
            baseline=baseline_bytes / 2**20,
            unit="MiB",
            goal=MEMORY_GOAL,
            direction="<=",
            detail=(
                f"ours: summed RSS of the {processes} processes `tinkerrpc serve` ran (server + engine), "
                f"sampled every {SAMPLE_SECONDS * 1000:.0f} ms through a {seconds:.0f} s demo (SFT ≤ "
                f"{settings.demo_sft_max_steps} steps, RL ≤ {settings.demo_rl_max_steps}); baseline: one "
                f"transformers+PEFT process training and sampling tiny-chat the same way"
            ),
        )
    ]
