"""`python -m bench [--short] [--device cuda] [--out bench/results.json]`: run every comparison, write
results.json and results.png beside it, print the markdown table. Exits 1 when a comparison could not run."""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from bench import (
    art_seed,
    fair_share,
    floor,
    machine,
    memory,
    multiturn,
    overhead,
    qwen3_width,
    real_model,
    report,
    retention,
    sampling,
    serialization,
    streaming,
    training,
    vllm_cpu,
)
from bench.vllm_venv import VllmUnavailable
from bench.workload import FULL, SHORT, BenchModel, Settings, prepare_model
from tinkerrpc_server.engine.runtime import PlacementError, resolve_placement
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.settings import ENGINE_DEVICE_ENV
from tinkerrpc_server.settings import Settings as ProcessSettings


@dataclass
class Context:
    settings: Settings
    model_dir: Path
    work_dir: Path
    threads: int
    stack: contextlib.ExitStack
    # Where every engine of the run computes, and the base-weight dtype there; the matmul peak is measured
    # there, and the in-process baselines compute there too (bench.workload.baseline_placement).
    device: torch.device
    dtype: torch.dtype
    _model: BenchModel | None = None
    _engine: LocalEngine | None = None
    _peak: tuple[float, int] | None = field(default=None)

    @property
    def model(self) -> BenchModel:
        if self._model is None:
            self._model = prepare_model(self.settings, self.model_dir)
        return self._model

    @property
    def engine(self) -> LocalEngine:
        """One engine process for the compute-bound figures, started on first use."""
        if self._engine is None:
            self._engine = self.stack.enter_context(
                LocalEngine(self.work_dir / "engine", self.model_dir, self.work_dir / "engine.log")
            )
        return self._engine

    def measure_peak_matmul(self) -> tuple[float, int]:
        """Measure the matmul peak again; keep and return the best seen in this run."""
        measured = machine.peak_matmul_flops(
            self.settings.matmul_sizes, self.settings.matmul_repeats, self.device, self.dtype
        )
        self._peak = measured if self._peak is None else max(self._peak, measured)
        return self._peak


def _training(ctx: Context) -> list[report.Figure]:
    return training.measure(ctx.settings, ctx.engine, ctx.model, ctx.measure_peak_matmul)


def _sampling(ctx: Context) -> list[report.Figure]:
    return sampling.measure(ctx.settings, ctx.engine, ctx.model)


def _multiturn(ctx: Context) -> list[report.Figure]:
    return multiturn.measure(ctx.settings, ctx.engine, ctx.model, ctx.model_dir)


def _qwen3_width(ctx: Context) -> list[report.Figure]:
    return qwen3_width.measure(ctx.settings.mode, ctx.engine, ctx.model_dir, ctx.measure_peak_matmul)


def _real_model(ctx: Context) -> list[report.Figure]:
    return real_model.measure(ctx.settings.mode, ctx.engine, ctx.model_dir, ctx.measure_peak_matmul)


def _fair_share(ctx: Context) -> list[report.Figure]:
    return fair_share.measure(ctx.settings.mode, ctx.engine, ctx.model_dir)


def _floor(ctx: Context) -> list[report.Figure]:
    return floor.measure(
        ctx.settings.mode, ctx.engine, ctx.model_dir, ctx.measure_peak_matmul, ctx.device, ctx.dtype
    )


def _overhead(ctx: Context) -> list[report.Figure]:
    return overhead.measure(ctx.settings, ctx.work_dir, ctx.model_dir)


def _serialization(ctx: Context) -> list[report.Figure]:
    return serialization.measure(ctx.settings)


def _memory(ctx: Context) -> list[report.Figure]:
    return memory.measure(ctx.settings, ctx.work_dir, ctx.model_dir)


def _retention(ctx: Context) -> list[report.Figure]:
    return retention.measure(ctx.settings, ctx.work_dir, ctx.model_dir)


def _art_seed(ctx: Context) -> list[report.Figure]:
    return art_seed.measure(ctx.settings, ctx.work_dir, ctx.model_dir)


class Skipped(Exception):
    """A comparison that cannot run on this machine or in this mode; the message says why."""


def _vllm(ctx: Context) -> list[report.Figure]:
    if ctx.settings.mode == "short":
        raise Skipped("full runs only (vLLM's start alone takes minutes)")
    if ctx.device.type != "cpu":
        raise Skipped("compares against vLLM's CPU build: CPU runs only")
    try:
        return vllm_cpu.measure(ctx.engine, ctx.model_dir, ctx.threads, ctx.work_dir)
    except VllmUnavailable as reason:
        raise Skipped(str(reason)) from None


def _streaming(ctx: Context) -> list[report.Figure]:
    if ctx.settings.mode == "short":
        raise Skipped("full runs only (SmolLM2-135M, and vLLM's start)")
    return streaming.measure(ctx.engine, ctx.model_dir, ctx.threads, ctx.work_dir)


COMPARISONS: dict[str, Callable[[Context], list[report.Figure]]] = {
    "training": _training,
    "sampling": _sampling,
    "multiturn": _multiturn,
    "overhead": _overhead,
    "serialization": _serialization,
    "memory": _memory,
    "retention": _retention,
    "art_seed": _art_seed,
    # Last: the engine holds these models (~0.5 GB, ~0.9 GB) from then on.
    "real_model": _real_model,
    "qwen3_width": _qwen3_width,
    "fair_share": _fair_share,
    "floor": _floor,
    "vllm": _vllm,
    "streaming": _streaming,
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench", description=__doc__)
    parser.add_argument("--short", action="store_true", help="small sizes: checks the harness, not the goals")
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "results.json")
    parser.add_argument(
        "--model-dir",
        type=Path,
        default=ProcessSettings.from_environment().model_dir,
        help="where bench models are cached",
    )
    parser.add_argument(
        "--threads",
        type=int,
        default=torch.get_num_threads(),
        help="torch threads of every side (in-process baselines and child processes alike); default: torch's",
    )
    parser.add_argument("--only", nargs="+", choices=sorted(COMPARISONS), help="run only these comparisons")
    parser.add_argument(
        "--device",
        default="cpu",
        help="torch device of every engine of the run: cpu or cuda[:N] (bf16 base weights there; "
        "docs/devices.md); default: %(default)s",
    )
    args = parser.parse_args(argv)
    try:
        device, dtype = resolve_placement(args.device)
    except PlacementError as error:
        parser.error(str(error))
    # Every engine the run starts, directly or under `serve`, reads its device from here.
    os.environ[ENGINE_DEVICE_ENV] = args.device
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    settings = SHORT if args.short else FULL
    threads = args.threads
    torch.set_num_threads(threads)
    # Every child (engine, server, sidecar) computes with the thread count of the in-process baselines.
    os.environ["OMP_NUM_THREADS"] = str(threads)
    started = time.perf_counter()
    results = report.Results(machine=machine.describe_machine(threads, device, dtype), mode=settings.mode)
    with tempfile.TemporaryDirectory(prefix="tinkerrpc-bench-") as tmp, contextlib.ExitStack() as stack:
        ctx = Context(settings, args.model_dir, Path(tmp), threads, stack, device, dtype)
        for name, run in COMPARISONS.items():
            if args.only and name not in args.only:
                continue
            print(f"[bench] {name} ...", file=sys.stderr, flush=True)
            step_started = time.perf_counter()
            try:
                figures = run(ctx)
            except Skipped as reason:
                print(f"[bench] {name} skipped: {reason}", file=sys.stderr, flush=True)
                results.skipped[name] = str(reason)
                continue
            except Exception as exc:
                traceback.print_exc()
                results.errors[name] = f"{type(exc).__name__}: {exc}"
                continue
            results.figures.extend(figures)
            for f in figures:
                print(
                    f"[bench]   {f.name}: {f.ratio_text()} ({f.ours:.4g} vs {f.baseline:.4g} {f.unit}) "
                    f"in {time.perf_counter() - step_started:.0f} s",
                    file=sys.stderr,
                    flush=True,
                )
        if ctx._peak is not None:
            results.machine["matmul_peak_gflops"] = round(ctx._peak[0] / 1e9, 2)
    results.wall_seconds = time.perf_counter() - started
    results.machine["load_average_at_end"] = os.getloadavg()
    results.write(args.out)
    if results.figures:
        report.plot_ratios(results, args.out.with_suffix(".png"))
    print(report.markdown_table(results))
    print(f"\n{settings.mode} run in {results.wall_seconds:.0f} s; results in {args.out}")
    return 1 if results.errors else 0


if __name__ == "__main__":
    sys.exit(main())
