"""Figures, the results.json file, the markdown table and the ratio chart."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Direction = Literal[">=", "<="]


@dataclass(frozen=True)
class Figure:
    """One comparison: `ratio` = ours / baseline, which must be `direction` `goal`."""

    name: str
    ours: float
    baseline: float
    unit: str
    goal: float
    direction: Direction
    detail: str = ""

    @property
    def ratio(self) -> float:
        return self.ours / self.baseline if self.baseline else math.inf

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal if self.direction == ">=" else self.ratio <= self.goal

    def to_json(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ours": self.ours,
            "baseline": self.baseline,
            "unit": self.unit,
            "ratio": self.ratio,
            "goal": self.goal,
            "direction": self.direction,
            "met": self.met,
            "detail": self.detail,
        }


def on_model(figures: list[Figure], label: str, goals: Mapping[str, float], about: str) -> list[Figure]:
    """Figures that a shared measurement (bench/training.py, bench/sampling.py) took on another model:
    `label` added to each name, the goal `goals` gives for its name on the bench model, and `about`
    (what the model is) appended to its detail."""
    return [
        replace(
            figure, name=f"{figure.name} ({label})", goal=goals[figure.name], detail=figure.detail + about
        )
        for figure in figures
    ]


@dataclass
class Results:
    machine: dict[str, Any]
    mode: Literal["full", "short"]
    figures: list[Figure] = field(default_factory=list)
    # Comparisons that could not run, by name: the run is incomplete and exits non-zero.
    errors: dict[str, str] = field(default_factory=dict)
    # Comparisons that cannot run on this machine or in this mode, by name, with why (not an error).
    skipped: dict[str, str] = field(default_factory=dict)
    wall_seconds: float = 0.0

    def to_json(self) -> dict[str, Any]:
        return {
            "machine": self.machine,
            "mode": self.mode,
            "wall_seconds": round(self.wall_seconds, 1),
            "figures": [f.to_json() for f in self.figures],
            "errors": self.errors,
            "skipped": self.skipped,
        }

    def write(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.to_json(), indent=2) + "\n")


def _number(value: float) -> str:
    if value == 0 or 0.01 <= abs(value) < 100_000:
        return f"{value:.3g}" if abs(value) < 100 else f"{value:,.0f}"
    return f"{value:.3g}"


def markdown_table(results: Results) -> str:
    lines = [
        "| figure | ours | baseline | unit | ratio | goal | met |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for f in results.figures:
        lines.append(
            f"| {f.name} | {_number(f.ours)} | {_number(f.baseline)} | {f.unit} | {f.ratio:.2f}× "
            f"| {f.direction} {f.goal:g}× | {'yes' if f.met else '**no**'} |"
        )
    for name, error in results.errors.items():
        lines.append(f"| {name} | – | – | – | – | – | error: {error} |")
    for name, reason in results.skipped.items():
        lines.append(f"| {name} | – | – | – | – | – | skipped: {reason} |")
    return "\n".join(lines)


def plot_ratios(results: Results, path: Path) -> None:
    """Horizontal bars of ours/baseline per figure, with the goal drawn as a tick on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = results.figures
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(figures) + 1.5))
    rows = list(range(len(figures)))[::-1]
    colors = ["tab:green" if f.met else "tab:red" for f in figures]
    ax.barh(rows, [f.ratio for f in figures], color=colors, height=0.6)
    ax.scatter([f.goal for f in figures], rows, marker="|", s=400, color="black", label="goal", zorder=3)
    for row, f in zip(rows, figures, strict=True):
        ax.text(f.ratio, row, f" {f.ratio:.2f}× ({f.direction} {f.goal:g})", va="center", fontsize=8)
    ax.set_yticks(rows, [f.name for f in figures], fontsize=8)
    ax.set_xlabel("ours / baseline")
    ax.set_xlim(0, max([f.ratio for f in figures] + [f.goal for f in figures]) * 1.35)
    ax.set_title(f"tinkerrpc benchmarks ({results.mode} run; green = goal met)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
