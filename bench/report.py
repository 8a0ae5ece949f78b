"""Figures, the results.json file, the markdown table and the ratio chart."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

Direction = Literal[">=", "<="]


def _ratio(ours: float, baseline: float) -> float:
    return ours / baseline if baseline else math.inf


@dataclass(frozen=True)
class Round:
    """One round of a figure: each side's value in the figure's unit."""

    ours: float
    baseline: float

    @property
    def ratio(self) -> float:
        return _ratio(self.ours, self.baseline)

    def to_json(self) -> dict[str, float]:
        return {"ours": self.ours, "baseline": self.baseline, "ratio": self.ratio}


def rounds(ours: Sequence[float], baseline: Sequence[float]) -> tuple[Round, ...]:
    """Each side's values, round i beside round i; a side measured once (a count, the matmul peak, a
    baseline run once) stands beside every round of the other."""
    if len(ours) == 1:
        ours = list(ours) * len(baseline)
    elif len(baseline) == 1:
        baseline = list(baseline) * len(ours)
    if not ours or len(ours) != len(baseline):
        raise ValueError(f"rounds of ours and the baseline differ in number: {len(ours)} vs {len(baseline)}")
    return tuple(Round(o, b) for o, b in zip(ours, baseline, strict=True))


@dataclass(frozen=True)
class Figure:
    """One comparison: `ratio` = ours / baseline, which must be `direction` `goal`. `ours` and `baseline`
    are the figure as its comparison computes it (mostly each side's median over its rounds); `rounds`
    (made by `rounds()`) are the values it was taken from, one for a figure measured once."""

    name: str
    ours: float
    baseline: float
    unit: str
    goal: float
    direction: Direction
    detail: str = ""
    rounds: tuple[Round, ...] = field(kw_only=True)

    @property
    def ratio(self) -> float:
        return _ratio(self.ours, self.baseline)

    @property
    def met(self) -> bool:
        return self.ratio >= self.goal if self.direction == ">=" else self.ratio <= self.goal

    @property
    def ratio_range(self) -> tuple[float, float] | None:
        """The least and greatest ratio of a round, where there is more than one round."""
        if len(self.rounds) < 2:
            return None
        ratios = [r.ratio for r in self.rounds]
        return min(ratios), max(ratios)

    def ratio_text(self) -> str:
        """`1.80×`, or `1.80× [1.71-1.93×]` with the min-max over more than one round."""
        spread = self.ratio_range
        return f"{self.ratio:.2f}×" + (f" [{spread[0]:.2f}-{spread[1]:.2f}×]" if spread else "")

    def to_json(self) -> dict[str, Any]:
        spread = self.ratio_range
        return {
            "name": self.name,
            "ours": self.ours,
            "baseline": self.baseline,
            "unit": self.unit,
            "ratio": self.ratio,
            "ratio_min_max": list(spread) if spread else None,
            "goal": self.goal,
            "direction": self.direction,
            "met": self.met,
            "detail": self.detail,
            "rounds": [r.to_json() for r in self.rounds],
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
        "| figure | ours | baseline | unit | ratio [min-max] | goal | met |",
        "|---|---:|---:|---|---:|---|---|",
    ]
    for f in results.figures:
        lines.append(
            f"| {f.name} | {_number(f.ours)} | {_number(f.baseline)} | {f.unit} | {f.ratio_text()} "
            f"| {f.direction} {f.goal:g}× | {'yes' if f.met else '**no**'} |"
        )
    for name, error in results.errors.items():
        lines.append(f"| {name} | – | – | – | – | – | error: {error} |")
    for name, reason in results.skipped.items():
        lines.append(f"| {name} | – | – | – | – | – | skipped: {reason} |")
    return "\n".join(lines)


def plot_ratios(results: Results, path: Path) -> None:
    """Horizontal bars of ours/baseline per figure, whiskers from the least to the greatest round's ratio,
    and the goal drawn as a tick on each bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figures = results.figures
    fig, ax = plt.subplots(figsize=(8, 0.6 * len(figures) + 1.5))
    rows = list(range(len(figures)))[::-1]
    colors = ["tab:green" if f.met else "tab:red" for f in figures]
    ratios = [f.ratio for f in figures]
    ax.barh(rows, ratios, color=colors, height=0.6)
    spans = [f.ratio_range or (f.ratio, f.ratio) for f in figures]
    ranged = [i for i, f in enumerate(figures) if f.ratio_range]
    if ranged:
        below = [max(0.0, ratios[i] - spans[i][0]) for i in ranged]
        above = [max(0.0, spans[i][1] - ratios[i]) for i in ranged]
        ax.errorbar(
            [ratios[i] for i in ranged],
            [rows[i] for i in ranged],
            xerr=[below, above],
            fmt="none",
            ecolor="dimgray",
            capsize=3,
            label="min-max over rounds",
        )
    ends = [max(ratio, high) for ratio, (_, high) in zip(ratios, spans, strict=True)]
    ax.scatter([f.goal for f in figures], rows, marker="|", s=400, color="black", label="goal", zorder=3)
    for row, f, end in zip(rows, figures, ends, strict=True):
        ax.text(end, row, f" {f.ratio_text()} ({f.direction} {f.goal:g})", va="center", fontsize=8)
    ax.set_yticks(rows, [f.name for f in figures], fontsize=8)
    ax.set_xlabel("ours / baseline")
    ax.set_xlim(0, max(ends + [f.goal for f in figures]) * 1.45)
    ax.set_title(f"tinkerrpc benchmarks ({results.mode} run; green = goal met)")
    # Below the axes: inside, it covered the last figure's label.
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.12), ncol=2, fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
