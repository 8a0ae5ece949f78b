"""Figure 6: peak PSS of the stack (`tinkerrpc serve` + its engine) while the demo runs through it, vs
one process doing the same kind of work in-process with transformers+PEFT (bench/memory_baseline.py).

PSS (proportional set size, Linux's /proc/<pid>/smaps_rollup) divides each resident page among the
processes that map it, so the libraries server and engine both map count once, as the machine pays for
them; summed RSS counted them once per process."""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path

import psutil

from bench.report import Figure, rounds
from bench.workload import Settings
from tinkerrpc_server.recipes.base import run_recipe
from tinkerrpc_server.recipes.yes_no_maybe.recipe import YesNoMaybeRecipe

MEMORY_GOAL = 1.5
# The kernel walks every mapping to sum a process's PSS (~10-25 ms for a process with torch loaded), so
# it is sampled less often than RSS could be.
SAMPLE_SECONDS = 0.2


def pss_bytes(pid: int) -> int:
    with open(f"/proc/{pid}/smaps_rollup") as rollup:
        for line in rollup:
            if line.startswith("Pss:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/{pid}/smaps_rollup has no Pss line")


class PeakPss:
    """Samples the summed PSS of the processes `select()` names, every SAMPLE_SECONDS, in a background
    thread."""

    def __init__(self, select: Callable[[], list[psutil.Process]]) -> None:
        self._select = select
        self._stop = threading.Event()
        self.peak_bytes = 0
        self.processes_seen: set[int] = set()
        self._thread = threading.Thread(target=self._run, name="pss-sampler", daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            total = 0
            for proc in self._select():
                try:
                    total += pss_bytes(proc.pid)
                    self.processes_seen.add(proc.pid)
                except OSError:
                    pass  # exited between listing and reading
            self.peak_bytes = max(self.peak_bytes, total)
            self._stop.wait(SAMPLE_SECONDS)

    def __enter__(self) -> PeakPss:
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
    recipe = YesNoMaybeRecipe(
        out_dir=work_dir / "demo",
        sft_max_steps=settings.demo_sft_max_steps,
        rl_max_steps=settings.demo_rl_max_steps,
        data_dir=work_dir / "demo-data",
    )
    failure: list[BaseException] = []

    def demo() -> None:
        try:
            run_recipe(recipe)
        except BaseException as exc:  # re-raised in the measuring thread
            failure.append(exc)

    started = time.perf_counter()
    with PeakPss(_new_descendants(existing)) as sampler:
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
    with PeakPss(lambda: [proc]) as sampler:
        code = proc.wait(600)
    if code != 0:
        raise RuntimeError(f"memory baseline exited with {code}:\n{log_path.read_text()[-3000:]}")
    return sampler.peak_bytes


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    stack_bytes, processes, seconds = _stack_peak(settings, work_dir)
    baseline_bytes = _baseline_peak(settings, model_dir, work_dir / "memory_baseline.log")
    stack_mib, baseline_mib = stack_bytes / 2**20, baseline_bytes / 2**20
    return [
        Figure(
            name="memory: peak PSS of server + engine in the demo",
            ours=stack_mib,
            baseline=baseline_mib,
            unit="MiB",
            goal=MEMORY_GOAL,
            direction="<=",
            rounds=rounds([stack_mib], [baseline_mib]),
            detail=(
                f"ours: summed PSS (shared pages counted once) of the {processes} processes `tinkerrpc "
                f"serve` ran (a server without torch + its engine), sampled every "
                f"{SAMPLE_SECONDS * 1000:.0f} ms through a {seconds:.0f} s demo (SFT ≤ "
                f"{settings.demo_sft_max_steps} steps, RL ≤ {settings.demo_rl_max_steps}); baseline: PSS of "
                f"one transformers+PEFT process training and sampling tiny-chat the same way"
            ),
        )
    ]
