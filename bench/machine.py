"""What the figures were measured on, and the machine's own matmul FLOP/s (the MFU denominator)."""

from __future__ import annotations

import os
import platform
import time
from typing import Any

import torch


def cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def describe_machine(threads: int, device: torch.device, dtype: torch.dtype) -> dict[str, Any]:
    import peft
    import tinker
    import transformers

    return {
        "cpu_model": cpu_model(),
        "logical_cores": os.cpu_count(),
        "usable_cores": len(os.sched_getaffinity(0)),
        "torch_threads": threads,
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "base_weights_dtype": str(dtype).removeprefix("torch."),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "peft": peft.__version__,
        "tinker": tinker.__version__,
        "platform": platform.platform(),
        "load_average_at_start": os.getloadavg(),
    }


def busy_cores(window: float, pid: int | None = None) -> float:
    """Cores' worth of CPU time spent over the next `window` seconds by every process on the machine
    (from /proc/stat), or by process `pid` alone (from /proc/PID/stat); 0.0 where there is none (a
    process that has ended spends none)."""

    def machine() -> tuple[int, int]:
        with open("/proc/stat") as handle:
            ticks = [int(field) for field in handle.readline().split()[1:]]
        idle = ticks[3] + ticks[4]  # idle + iowait
        return sum(ticks) - idle, sum(ticks)

    def process() -> tuple[int, int]:
        with open(f"/proc/{pid}/stat") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        # utime and stime (fields 14 and 15 of proc(5)); clock ticks against elapsed ticks.
        ticks_per_second = os.sysconf("SC_CLK_TCK")
        return int(fields[11]) + int(fields[12]), int(time.monotonic() * ticks_per_second)

    read = machine if pid is None else process
    try:
        busy_before, total_before = read()
        time.sleep(window)
        busy_after, total_after = read()
    except OSError:
        return 0.0
    if pid is not None:
        return (busy_after - busy_before) / max(1, total_after - total_before)
    cores = os.cpu_count() or 1
    return cores * (busy_after - busy_before) / max(1, total_after - total_before)


def wait_for_quiet_cpu(
    max_busy_cores: float = 0.15, window: float = 0.5, timeout: float = 30.0, pid: int | None = None
) -> tuple[bool, float]:
    """Wait until the machine's CPUs (or process `pid`'s) are quiet (at most `max_busy_cores` busy over a
    `window`), at most `timeout` seconds: a server that busy-waits for more work after answering (vLLM's
    CPU worker does, for about a second) would otherwise take a core from whatever is timed next.
    Returns (quiet, the seconds waited)."""
    started = time.monotonic()
    while True:
        if busy_cores(window, pid) <= max_busy_cores:
            return True, time.monotonic() - started
        if time.monotonic() - started >= timeout:
            return False, time.monotonic() - started


def matmul_flops(size: int, repeats: int, device: torch.device, dtype: torch.dtype) -> float:
    """Peak FLOP/s of square matmuls on `device` in `dtype` (the engine's base weights): the fastest of
    `repeats` timed runs after a warm-up (the fastest, because other load on the machine only ever slows
    a run down)."""
    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    torch.mm(a, b)
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        torch.mm(a, b)
        synchronize(device)
        times.append(time.perf_counter() - started)
    return 2 * size**3 / min(times)


def synchronize(device: torch.device) -> None:
    """CUDA runs kernels asynchronously: wait for them before reading the clock."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def peak_matmul_flops(
    sizes: tuple[int, ...], repeats: int, device: torch.device, dtype: torch.dtype
) -> tuple[float, int]:
    """The best of matmul_flops over the sizes: (FLOP/s, size that reached it)."""
    best = max((matmul_flops(size, repeats, device, dtype), size) for size in sizes)
    return best[0], best[1]
