"""The engine's request log (engine/request_log.py), behind the SDK's audit log and session traces: what
a request is recorded as, what is left out (polling, the credential itself), and how long entries stay."""

from __future__ import annotations

import json
import time

import pytest
from fastapi import FastAPI
from starlette.testclient import TestClient

from tinkerrpc_server.engine.request_log import (
    RETENTION_SECONDS,
    Entry,
    RequestLog,
    RequestLogMiddleware,
    audit_entries,
    perfetto_trace,
)

pytestmark = pytest.mark.unit

KEY = "tml-" + "k" * 40


def logged_app() -> tuple[TestClient, RequestLog]:
    app = FastAPI()
    log = RequestLog()

    @app.post("/api/v1/save_weights")
    async def save(body: dict[str, object]) -> dict[str, str]:
        return {"request_id": "r-1", "model_id": str(body["model_id"])}

    @app.post("/api/v1/retrieve_future")
    async def poll() -> dict[str, str]:
        return {}

    @app.post("/api/v1/forward_backward")
    async def step() -> dict[str, str]:
        return {"request_id": "r-2", "model_id": "s1:train:0"}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{kind}/{name}")
    async def delete(model_id: str, kind: str, name: str) -> dict[str, str]:
        return {}

    app.add_middleware(RequestLogMiddleware, log=log, credential_header=b"x-api-key")
    return TestClient(app), log


def test_each_request_is_recorded_with_the_ids_it_names_and_never_its_credential() -> None:
    client, log = logged_app()
    headers = {"X-API-Key": KEY}
    body = {"model_id": "s1:train:0", "path": "step-1", "seq_id": 3}
    assert client.post("/api/v1/save_weights", json=body, headers=headers).status_code == 200
    client.post("/api/v1/retrieve_future", json={"request_id": "r-1"}, headers=headers)
    client.post("/api/v1/forward_backward", content=b"\x00protobuf", headers={"X-API-Key": "eyJx.y.z"})
    client.delete("/api/v1/training_runs/s1:train:0/checkpoints/weights/step-1")

    events = log.entries(steps=False)
    assert [(e.event, e.method, e.status) for e in events] == [
        ("checkpoint_save", "POST", 200),
        ("checkpoint_delete", "DELETE", 200),
    ]
    save, delete = events
    assert save.ids == {"model_id": "s1:train:0", "request_id": "r-1"} and save.credential == "api_key"
    assert delete.ids == {"model_id": "s1:train:0", "tinker_path": "tinker://s1:train:0/weights/step-1"}
    assert delete.credential == "none"
    [step] = [e for e in log.entries(steps=True) if e not in events]  # a step: not an audit event
    assert (step.event, step.credential, step.ids["model_id"]) == (
        "training_run_forward_backward",
        "token",
        "s1:train:0",
    )
    recorded = json.dumps([e.details() for e in log.entries(steps=True)])
    assert KEY not in recorded and "eyJ" not in recorded and "retrieve_future" not in recorded


def test_entries_go_after_the_retention_and_views_select_by_day_type_and_session() -> None:
    log = RequestLog()
    now = time.time()
    old = Entry(
        now - RETENTION_SECONDS - 1, 0.001, "POST", "/api/v1/save_weights", 200, "checkpoint_save", "api_key"
    )
    log.add(old)
    log.add(
        Entry(
            now,
            0.002,
            "POST",
            "/api/v1/create_session",
            200,
            "session_create",
            "api_key",
            {"session_id": "s1"},
        )
    )
    log.add(
        Entry(
            now,
            0.003,
            "PUT",
            "/api/v1/sessions/s1/project",
            200,
            "project_session_assign",
            "api_key",
            {"session_id": "s1"},
        )
    )
    log.add(
        Entry(
            now,
            0.004,
            "POST",
            "/api/v1/asample",
            200,
            "sampler_sample",
            "token",
            {"sampling_session_id": "s2:sample:0"},
        )
    )
    assert old not in log.entries(steps=True)

    day_start = now - (now % 86400)
    assert [e.event for e in audit_entries(log, "all", day_start)] == [
        "session_create",
        "project_session_assign",
    ]
    assert [e.event for e in audit_entries(log, "projects", day_start)] == ["project_session_assign"]
    assert audit_entries(log, "checkpoints", day_start) == audit_entries(log, "teams", day_start) == []
    assert audit_entries(log, "all", day_start - 86400) == []

    trace = json.loads(perfetto_trace("s1", log.entries(steps=True)))
    slices = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert [e["name"] for e in slices] == ["session_create", "project_session_assign"]
    assert [e["dur"] for e in slices] == [2000, 3000]  # microseconds
    assert {e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "thread_name"} == {"s1"}
