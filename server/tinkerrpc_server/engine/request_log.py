"""The engine's own request log: what each HTTP request asked, of what, when, and how it was answered.

It answers the SDK's audit log (AdminClient.get_audit_log) and a session's trace export
(RestClient.export_session_trace). An ASGI middleware records every request but the polling and
keep-alive ones (`_UNLOGGED`), after its answer, with the ids it names: in its path, in a JSON body of at
most `_PARSED_BODY_BYTES` (request) or `_PARSED_ANSWER_BYTES` (answer: a future's model_id). No secret is
recorded: of the credential only its kind (API key, token, none).

Retention: entries older than RETENTION_SECONDS go, and at most MAX_EVENTS entries of every kind but
training steps and samples, and MAX_STEPS of those (they come by the thousand per RL step and would
otherwise push everything else out). The log lives in memory and starts empty with each engine.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Message, Receive, Scope, Send

RETENTION_SECONDS = 7 * 86400
MAX_EVENTS = 10_000
MAX_STEPS = 20_000
_PARSED_BODY_BYTES = 64 * 1024
_PARSED_ANSWER_BYTES = 4096
_PREFIX = "/api/v1/"
_UNLOGGED = frozenset(
    {
        "healthz",
        "retrieve_future",
        "retrieve_futures",
        "session_heartbeat",
        "telemetry",
        "client/dynamic_config",
    }
)
_STEPS = frozenset({"forward_backward", "optim_step", "asample", "tinkerrpc/sample_stream"})
# (method, path pattern after /api/v1/) -> event: `<resource>_<action>`, as Tinker names audit events.
_EVENTS: tuple[tuple[str, re.Pattern[str], str], ...] = tuple(
    (method, re.compile(pattern), event)
    for method, pattern, event in (
        ("POST", r"save_weights(_for_sampler|_external)?", "checkpoint_save"),
        ("POST", r"load_weights", "checkpoint_load"),
        ("POST", r"copy_weights", "checkpoint_copy"),
        ("POST", r"weights_info", "checkpoint_info"),
        ("POST", r"training_runs/[^/]+/checkpoints/.+/publish", "checkpoint_publish"),
        ("DELETE", r"training_runs/[^/]+/checkpoints/.+/publish", "checkpoint_unpublish"),
        ("PUT", r"training_runs/[^/]+/checkpoints/.+/ttl", "checkpoint_ttl_set"),
        ("GET", r"training_runs/[^/]+/checkpoints/.+/external_weights_urls", "checkpoint_download_urls"),
        ("GET", r"external_weights_files/.+", "checkpoint_download"),
        ("DELETE", r"training_runs/[^/]+/checkpoints/.+", "checkpoint_delete"),
        ("GET", r"(training_runs/[^/]+/)?checkpoints", "checkpoint_list"),
        ("PUT", r"sessions/[^/]+/project", "project_session_assign"),
        ("POST", r"create_session", "session_create"),
        ("POST", r"sessions/[^/]+/finish", "session_finish"),
        ("GET", r"sessions/[^/]+/trace_export", "session_trace_export"),
        ("GET", r"session_traces/.+", "session_trace_download"),
        ("POST", r"sessions/search", "session_search"),
        ("GET", r"sessions(/[^/]+)?", "session_read"),
        ("POST", r"create_model", "training_run_create"),
        ("POST", r"unload_model", "training_run_unload"),
        ("POST", r"forward_backward", "training_run_forward_backward"),
        ("POST", r"optim_step", "training_run_optim_step"),
        ("GET", r"training_runs(/[^/]+)?", "training_run_read"),
        ("POST", r"create_sampling_session", "sampler_create"),
        ("POST", r"asample", "sampler_sample"),
        ("POST", r"tinkerrpc/sample_stream", "sampler_sample_stream"),
        ("POST", r"auth/token", "auth_token_issue"),
        ("GET", r"(audit|billing/.+)", "admin_read"),
    )
)
# The SDK's audit event types and the resources each covers (teams and organizations: none here).
EVENT_TYPES: dict[str, tuple[str, ...]] = {
    "all": (),
    "checkpoints": ("checkpoint",),
    "projects": ("project",),
    "teams": ("team",),
    "organizations": ("organization",),
}
# The ids a JSON body names, found by a pattern rather than parsed: a sample's body is mostly its prompt,
# which a JSON parse reads whole (25 us for 300 tokens, 1.6 ms for 12 000; the pattern 2 us and 60 us).
_ID_FIELDS = frozenset({"session_id", "model_id", "sampling_session_id", "request_id"})
_NAMED_ID = re.compile(
    rb'"(session_id|model_id|sampling_session_id|request_id|path|source_path|model_path|tinker_path)"'
    rb'\s*:\s*"([^"\\]{1,512})"'
)


@dataclass(slots=True)
class Entry:
    """One request: `at` is when it arrived (POSIX seconds), `ids` what it named (session_id, model_id,
    sampling_session_id, request_id, tinker_path)."""

    at: float
    duration: float
    method: str
    path: str
    status: int
    event: str
    credential: str
    ids: dict[str, str] = field(default_factory=dict)

    @property
    def resource(self) -> str:
        return self.event.split("_", 1)[0]

    def concerns(self, session_id: str) -> bool:
        """Whether it named the session, or a training client or sampling session of it."""
        return any(
            value == session_id or value.startswith(f"{session_id}:")
            for key, value in self.ids.items()
            if key in ("session_id", "model_id", "sampling_session_id")
        )

    def details(self) -> dict[str, object]:
        """What the SDK's AuditLogEntry.event_details holds for it."""
        return {
            "method": self.method,
            "path": self.path,
            "status": self.status,
            "duration_ms": round(self.duration * 1000, 3),
            "credential": self.credential,
            **self.ids,
        }


def _event(method: str, route: str) -> str:
    return next(
        (event for m, pattern, event in _EVENTS if m == method and pattern.fullmatch(route)),
        f"request_{method.lower()}",
    )


def _named_ids(chunks: list[bytes], into: dict[str, str]) -> None:
    """The ids (and a tinker:// path) a JSON body names, each field's first, added to `into`."""
    for match in _NAMED_ID.finditer(b"".join(chunks)):
        field, value = match.group(1).decode(), match.group(2).decode(errors="replace")
        if field in _ID_FIELDS:
            into.setdefault(field, value[:256])
        elif value.startswith("tinker://"):
            into.setdefault("tinker_path", value)


def _path_ids(route: str) -> dict[str, str]:
    parts = route.split("/")
    if len(parts) >= 2 and parts[0] == "training_runs":
        found = {"model_id": parts[1]}
        if len(parts) >= 5 and parts[2] == "checkpoints":
            found["tinker_path"] = f"tinker://{parts[1]}/{parts[3]}/{parts[4]}"
        return found
    if len(parts) >= 2 and parts[0] in ("sessions", "session_traces") and parts[1] != "search":
        return {"session_id": parts[1].removesuffix(".json")}
    return {}


class RequestLog:
    """Thread-safe: the middleware appends on the event loop, readers read from any thread."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._events: deque[Entry] = deque(maxlen=MAX_EVENTS)
        self._steps: deque[Entry] = deque(maxlen=MAX_STEPS)

    def add(self, entry: Entry) -> None:
        with self._lock:
            (self._steps if entry.path.removeprefix(_PREFIX) in _STEPS else self._events).append(entry)
            cutoff = time.time() - RETENTION_SECONDS
            for kept in (self._events, self._steps):
                while kept and kept[0].at < cutoff:
                    kept.popleft()

    def entries(self, *, steps: bool) -> list[Entry]:
        """Every entry kept, oldest first; with `steps`, training steps and samples too."""
        with self._lock:
            found = [*self._events, *(self._steps if steps else ())]
        return sorted(found, key=lambda e: e.at)


def audit_entries(log: RequestLog, event_type: str, day_start: float) -> list[Entry]:
    """The entries of one UTC day (from `day_start`, POSIX seconds) of the resources `event_type`
    covers, oldest first; training steps and samples are in session traces, not here."""
    resources = EVENT_TYPES[event_type]
    return [
        e
        for e in log.entries(steps=False)
        if day_start <= e.at < day_start + 86400 and (not resources or e.resource in resources)
    ]


def perfetto_trace(session_id: str, entries: Iterable[Entry]) -> bytes:
    """A session's requests as a Chrome trace-event JSON file, which ui.perfetto.dev opens: one slice
    per request (its arrival to its answer), one track per training client or sampling session."""
    events: list[dict[str, object]] = []
    tracks: dict[str, int] = {}
    for entry in entries:
        if not entry.concerns(session_id):
            continue
        lane = entry.ids.get("model_id") or entry.ids.get("sampling_session_id") or session_id
        track = tracks.setdefault(lane, len(tracks) + 1)
        events.append(
            {
                "name": entry.event,
                "ph": "X",
                "ts": round(entry.at * 1e6),
                "dur": max(1, round(entry.duration * 1e6)),
                "pid": 1,
                "tid": track,
                "args": entry.details(),
            }
        )
    names = [
        {"name": "thread_name", "ph": "M", "pid": 1, "tid": track, "args": {"name": lane}}
        for lane, track in tracks.items()
    ]
    process = {"name": "process_name", "ph": "M", "pid": 1, "args": {"name": f"session {session_id}"}}
    return json.dumps({"traceEvents": [process, *names, *events], "displayTimeUnit": "ms"}).encode()


def utc(at: float) -> datetime:
    return datetime.fromtimestamp(at, timezone.utc)


class RequestLogMiddleware:
    """Records each request in `log` once it is answered (see the module docstring)."""

    def __init__(self, app: ASGIApp, log: RequestLog, credential_header: bytes) -> None:
        self._app = app
        self._log = log
        self._credential_header = credential_header

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        route = scope["path"].removeprefix(_PREFIX) if scope["type"] == "http" else ""
        if not route or route in _UNLOGGED or not scope["path"].startswith(_PREFIX):
            await self._app(scope, receive, send)
            return
        headers = dict(scope["headers"])
        body: list[bytes] = []
        answer: list[bytes] = []
        declared = headers.get(b"content-length", b"")
        parse_body = (
            b"json" in headers.get(b"content-type", b"")
            and declared.isdigit()
            and int(declared) <= _PARSED_BODY_BYTES
        )
        status = 500

        async def receive_logged() -> Message:
            message = await receive()
            if parse_body and message["type"] == "http.request":
                body.append(message.get("body", b""))
            return message

        async def send_logged(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            elif message["type"] == "http.response.body" and sum(map(len, answer)) < _PARSED_ANSWER_BYTES:
                answer.append(message.get("body", b""))
            await send(message)

        started, clock = time.time(), time.monotonic()
        try:
            await self._app(scope, receive_logged, send_logged)
        finally:
            ids = _path_ids(route)
            if body:
                _named_ids(body, ids)
            if answer and sum(map(len, answer)) < _PARSED_ANSWER_BYTES:
                _named_ids(answer, ids)
            credential = headers.get(self._credential_header, b"")
            kind = "token" if credential.startswith(b"eyJ") else "api_key" if credential else "none"
            method = scope["method"]
            self._log.add(
                Entry(
                    started,
                    time.monotonic() - clock,
                    method,
                    scope["path"],
                    status,
                    _event(method, route),
                    kind,
                    ids,
                )
            )
