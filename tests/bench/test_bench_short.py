"""`python -m bench --short` end to end: every comparison runs against real processes and results.json
(each figure with the rounds it was taken from), the markdown table and the chart come out well formed.
No ratio is asserted: short sizes prove the harness, not the goals."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.ecosystem

REPO = Path(__file__).resolve().parents[2]
FIGURE_KEYS = {
    "name",
    "ours",
    "baseline",
    "unit",
    "ratio",
    "ratio_min_max",
    "goal",
    "direction",
    "met",
    "detail",
    "rounds",
}
EXPECTED_FIGURES = {
    "engine training throughput",
    "training MFU (6·P·tokens/s ÷ matmul peak)",
    "engine sampling throughput",
    "sampling, staggered arrivals: throughput",
    "sampling, staggered arrivals: p50 latency",
    "sampling, shared prompts",
    "multi-turn RL step, tokens processed",
    "multi-turn RL step, Train time",
    "stack overhead: Train RPC vs tinker SDK",
    "sidecar overhead: chat completion vs Sample RPC",
    "Train request encode+decode",
    "memory: peak PSS of server + engine in the demo",
    "retention: disk late in a run vs early",
    "retention: step time late in a run vs early",
    "retention: step time after restores vs before",
    "engine training throughput (Qwen3-0.6B width)",
    "training MFU (6·P·tokens/s ÷ matmul peak) (Qwen3-0.6B width)",
    "engine sampling throughput (Qwen3-0.6B width)",
    "engine training throughput (SmolLM2-135M)",
    "training MFU (6·P·tokens/s ÷ matmul peak) (SmolLM2-135M)",
    "engine sampling throughput (SmolLM2-135M)",
    "sampling, staggered arrivals: throughput (SmolLM2-135M)",
    "sampling, staggered arrivals: p50 latency (SmolLM2-135M)",
    "fair share: tiny-chat p50 latency while SmolLM2 samples",
    "sampling at the machine's floor, 1 row (SmolLM2-135M)",
    "sampling at the machine's floor, 2 rows (SmolLM2-135M)",
}


def test_short_run_writes_well_formed_results(tmp_path: Path) -> None:
    out = tmp_path / "results.json"
    cmd = [
        sys.executable,
        "-m",
        "bench",
        "--short",
        "--out",
        str(out),
        "--model-dir",
        str(tmp_path / "models"),
    ]
    run = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-5000:]

    results = json.loads(out.read_text())
    assert results["mode"] == "short"
    assert results["errors"] == {}
    # vLLM's start takes minutes (and streaming measures against it): the short run names them as
    # skipped, and why.
    assert results["skipped"] == {
        "vllm": "full runs only (vLLM's start alone takes minutes)",
        "streaming": "full runs only (SmolLM2-135M, and vLLM's start)",
    }
    machine = results["machine"]
    assert machine["cpu_model"] and machine["torch"] and machine["torch_threads"] >= 1
    assert machine["matmul_peak_gflops"] > 0
    figures = results["figures"]
    assert {f["name"] for f in figures} == EXPECTED_FIGURES
    for f in figures:
        assert set(f) == FIGURE_KEYS, f
        assert math.isfinite(f["ours"]) and f["ours"] > 0, f
        assert math.isfinite(f["baseline"]) and f["baseline"] > 0, f
        assert math.isclose(f["ratio"], f["ours"] / f["baseline"], rel_tol=1e-9), f
        assert f["direction"] in (">=", "<=") and f["goal"] > 0, f
        assert f["met"] == (f["ratio"] >= f["goal"] if f["direction"] == ">=" else f["ratio"] <= f["goal"]), f
        # Every figure records the rounds it was taken from; each side's figure lies within its rounds.
        assert f["rounds"], f
        for side in ("ours", "baseline"):
            values = [r[side] for r in f["rounds"]]
            assert min(values) * (1 - 1e-9) <= f[side] <= max(values) * (1 + 1e-9), f
        ratios = [r["ratio"] for r in f["rounds"]]
        assert all(math.isclose(r["ratio"], r["ours"] / r["baseline"], rel_tol=1e-9) for r in f["rounds"]), f
        assert f["ratio_min_max"] == ([min(ratios), max(ratios)] if len(ratios) > 1 else None), f
    # The short run's overhead figures take 3 steps a side: their rows show the rounds' min-max.
    stack = next(f for f in figures if f["name"] == "stack overhead: Train RPC vs tinker SDK")
    low, high = stack["ratio_min_max"]
    assert f"| {stack['ratio']:.2f}× [{low:.2f}-{high:.2f}×] |" in run.stdout

    assert out.with_suffix(".png").read_bytes().startswith(b"\x89PNG")
    table_rows = [line for line in run.stdout.splitlines() if line.startswith("| ")]
    # The header, one row per figure, one per skipped comparison.
    assert len(table_rows) == 1 + len(EXPECTED_FIGURES) + len(results["skipped"])
    assert "| vllm | – | – | – | – | – | skipped: full runs only" in run.stdout
