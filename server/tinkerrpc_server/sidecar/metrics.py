"""A minimal Prometheus registry (counters and a histogram, text exposition format 0.0.4)."""

from __future__ import annotations

import bisect
import math
import threading
from collections.abc import Sequence

Labels = tuple[str, ...]

# Sampling on CPU ranges from milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _label_text(names: Sequence[str], values: Sequence[str], extra: str = "") -> str:
    pairs = [f'{n}="{_escape(v)}"' for n, v in zip(names, values, strict=True)]
    if extra:
        pairs.append(extra)
    return "{" + ",".join(pairs) + "}" if pairs else ""


def _number(value: float) -> str:
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    return repr(float(value)) if not float(value).is_integer() else str(int(value))


class Counter:
    def __init__(self, name: str, help_text: str, label_names: Sequence[str] = ()) -> None:
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)
        self._values: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def inc(self, *label_values: str, amount: float = 1.0) -> None:
        if amount < 0:
            raise ValueError(f"counter {self.name} can only increase, got {amount}")
        if len(label_values) != len(self.label_names):
            raise ValueError(f"counter {self.name} takes labels {self.label_names}, got {label_values}")
        with self._lock:
            self._values[label_values] = self._values.get(label_values, 0.0) + amount

    def value(self, *label_values: str) -> float:
        with self._lock:
            return self._values.get(label_values, 0.0)

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} counter"]
        with self._lock:
            items = sorted(self._values.items())
        lines.extend(
            f"{self.name}{_label_text(self.label_names, labels)} {_number(v)}" for labels, v in items
        )
        return lines


class Histogram:
    def __init__(
        self,
        name: str,
        help_text: str,
        label_names: Sequence[str] = (),
        buckets: Sequence[float] = LATENCY_BUCKETS,
    ) -> None:
        if list(buckets) != sorted(buckets) or not buckets:
            raise ValueError("histogram buckets must be a non-empty ascending sequence")
        self.name = name
        self.help_text = help_text
        self.label_names = tuple(label_names)
        self.buckets = tuple(buckets)
        # Per label set: per-bucket (non-cumulative) counts with a final +Inf slot, the sum, the count.
        self._counts: dict[Labels, list[int]] = {}
        self._sums: dict[Labels, float] = {}
        self._lock = threading.Lock()

    def observe(self, value: float, *label_values: str) -> None:
        if len(label_values) != len(self.label_names):
            raise ValueError(f"histogram {self.name} takes labels {self.label_names}, got {label_values}")
        slot = bisect.bisect_left(self.buckets, value)
        with self._lock:
            counts = self._counts.setdefault(label_values, [0] * (len(self.buckets) + 1))
            counts[slot] += 1
            self._sums[label_values] = self._sums.get(label_values, 0.0) + value

    def count(self, *label_values: str) -> int:
        with self._lock:
            return sum(self._counts.get(label_values, ()))

    def render(self) -> list[str]:
        lines = [f"# HELP {self.name} {self.help_text}", f"# TYPE {self.name} histogram"]
        with self._lock:
            items = sorted(
                (labels, list(counts), self._sums[labels]) for labels, counts in self._counts.items()
            )
        for labels, counts, total in items:
            cumulative = 0
            for bound, count in zip((*self.buckets, math.inf), counts, strict=True):
                cumulative += count
                le = f'le="{_number(bound)}"'
                lines.append(f"{self.name}_bucket{_label_text(self.label_names, labels, le)} {cumulative}")
            lines.append(f"{self.name}_sum{_label_text(self.label_names, labels)} {_number(total)}")
            lines.append(f"{self.name}_count{_label_text(self.label_names, labels)} {cumulative}")
        return lines


class SidecarMetrics:
    """The sidecar's figures, rendered for GET /metrics."""

    CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

    def __init__(self) -> None:
        self.requests = Counter(
            "tinkerrpc_sidecar_requests_total", "HTTP requests by route and status code.", ("route", "status")
        )
        self.latency = Histogram(
            "tinkerrpc_sidecar_request_duration_seconds",
            "Time from request to response headers (a whole sample for streams).",
            ("route",),
        )
        self.generated_tokens = Counter(
            "tinkerrpc_sidecar_generated_tokens_total", "Completion tokens returned to clients.", ("route",)
        )
        self.prompt_tokens = Counter(
            "tinkerrpc_sidecar_prompt_tokens_total", "Prompt tokens of served requests.", ("route",)
        )
        self.errors = Counter(
            "tinkerrpc_sidecar_errors_total", "Error responses by status code.", ("status",)
        )

    def render(self) -> str:
        metrics = (self.requests, self.latency, self.generated_tokens, self.prompt_tokens, self.errors)
        return "\n".join(line for metric in metrics for line in metric.render()) + "\n"
