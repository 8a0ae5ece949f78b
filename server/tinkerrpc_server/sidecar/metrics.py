"""The sidecar's Prometheus metrics, served at GET /metrics."""

from __future__ import annotations

from prometheus_client import CONTENT_TYPE_PLAIN_0_0_4, CollectorRegistry, Counter, Histogram, generate_latest

# Sampling on CPU ranges from milliseconds to minutes.
LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)


class SidecarMetrics:
    """The sidecar's figures in a registry of their own: one per app, never the process-wide default
    (which would refuse a second app's metrics of the same names, e.g. in tests)."""

    CONTENT_TYPE = CONTENT_TYPE_PLAIN_0_0_4  # what generate_latest writes

    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "tinkerrpc_sidecar_requests_total",
            "HTTP requests by route and status code.",
            ("route", "status"),
            registry=self.registry,
        )
        self.latency = Histogram(
            "tinkerrpc_sidecar_request_duration_seconds",
            "Time from request to response headers (a whole sample for streams).",
            ("route",),
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.generated_tokens = Counter(
            "tinkerrpc_sidecar_generated_tokens_total",
            "Completion tokens returned to clients.",
            ("route",),
            registry=self.registry,
        )
        self.prompt_tokens = Counter(
            "tinkerrpc_sidecar_prompt_tokens_total",
            "Prompt tokens of served requests.",
            ("route",),
            registry=self.registry,
        )
        self.coalesced_requests = Counter(
            "tinkerrpc_sidecar_coalesced_requests_total",
            "Requests drawn in one Sample call with identical requests that arrived with them.",
            registry=self.registry,
        )
        self.errors = Counter(
            "tinkerrpc_sidecar_errors_total",
            "Error responses by status code.",
            ("status",),
            registry=self.registry,
        )

    def render(self) -> str:
        return generate_latest(self.registry).decode()
