"""bench/report.py: a figure's goal, the rounds it records and how results.json and the markdown table show
them (the ratio, and its min-max over the rounds where there is more than one; tests/bench/
test_bench_short.py checks the chart)."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bench.report import Figure, Results, Round, markdown_table, rounds

pytestmark = pytest.mark.unit


def test_goal_direction_decides_met() -> None:
    faster = Figure(
        "throughput",
        ours=30.0,
        baseline=10.0,
        unit="tokens/s",
        goal=4.0,
        direction=">=",
        rounds=rounds([30], [10]),
    )
    leaner = Figure(
        "overhead", ours=11.0, baseline=10.0, unit="ms", goal=1.15, direction="<=", rounds=rounds([11], [10])
    )
    assert (faster.ratio, faster.met) == (3.0, False)
    assert math.isclose(leaner.ratio, 1.1) and leaner.met
    table = markdown_table(Results(machine={}, mode="short", figures=[faster, leaner]))
    assert "| throughput | 30 | 10 | tokens/s | 3.00× | >= 4× | **no** |" in table
    assert "| overhead | 11 | 10 | ms | 1.10× | <= 1.15× | yes |" in table


def test_rounds_pair_round_i_of_each_side_and_a_side_measured_once_stands_beside_every_round() -> None:
    assert rounds([4.0, 6.0], [2.0, 3.0]) == (Round(4.0, 2.0), Round(6.0, 3.0))
    assert rounds([4.0, 6.0, 9.0], [3.0]) == (Round(4.0, 3.0), Round(6.0, 3.0), Round(9.0, 3.0))
    assert rounds([2.0], [1.0, 4.0]) == (Round(2.0, 1.0), Round(2.0, 4.0))
    assert [r.ratio for r in rounds([4.0, 6.0], [2.0, 0.0])] == [2.0, math.inf]
    with pytest.raises(ValueError, match="differ in number: 2 vs 3"):
        rounds([1.0, 2.0], [1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match="differ in number: 0 vs 0"):
        rounds([], [])


def test_the_min_max_of_the_rounds_ratios_is_written_and_printed_beside_the_ratio(tmp_path: Path) -> None:
    spread = Figure(
        "sampling",
        ours=20.0,
        baseline=4.0,
        unit="new tokens/s",
        goal=5.0,
        direction=">=",
        rounds=rounds([18.0, 20.0, 30.0], [4.0, 5.0, 4.0]),
    )
    once = Figure(
        "memory",
        ours=500.0,
        baseline=400.0,
        unit="MiB",
        goal=1.5,
        direction="<=",
        rounds=rounds([500], [400]),
    )
    assert (spread.ratio, spread.ratio_range, spread.ratio_text()) == (5.0, (4.0, 7.5), "5.00× [4.00-7.50×]")
    assert (once.ratio_range, once.ratio_text()) == (None, "1.25×")

    results = Results(machine={}, mode="full", figures=[spread, once])
    table = markdown_table(results)
    assert "| sampling | 20 | 4 | new tokens/s | 5.00× [4.00-7.50×] | >= 5× | yes |" in table
    assert "| memory | 500 | 400 | MiB | 1.25× | <= 1.5× | yes |" in table

    path = tmp_path / "results.json"
    results.write(path)
    written = {f["name"]: f for f in json.loads(path.read_text())["figures"]}
    assert written["sampling"]["ratio_min_max"] == [4.0, 7.5]
    assert written["sampling"]["rounds"] == [
        {"ours": 18.0, "baseline": 4.0, "ratio": 4.5},
        {"ours": 20.0, "baseline": 5.0, "ratio": 4.0},
        {"ours": 30.0, "baseline": 4.0, "ratio": 7.5},
    ]
    assert written["memory"]["ratio_min_max"] is None
    assert written["memory"]["rounds"] == [{"ours": 500.0, "baseline": 400.0, "ratio": 1.25}]
