"""Sessions: creating and finishing them, and the SDK's RestClient views of them (list_sessions,
get_session, search_sessions, assign_session_project, export_session_trace), answered from the engine's
own session records (engine/sessions.py, engine/records.py) and request log (engine/request_log.py).

Local meanings: every session is the one principal's (whoever holds the engine's key), so `access_scope`
and the search's owner select the same sessions; a project is a label a session carries (there is no
project registry to refuse one); a session's status is `active` while its client heartbeats, its
client's finish once it finished, and None when it stopped without finishing.
"""

from __future__ import annotations

import logging
import time
from datetime import datetime
from typing import Literal

from fastapi import APIRouter, Request
from fastapi.responses import Response
from pydantic import BaseModel, ConfigDict, Field
from tinker import types

from tinkerrpc.contract.limits import MAX_ENGINE_LABELS
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.records import SessionView
from tinkerrpc_server.engine.request_log import RequestLog, perfetto_trace
from tinkerrpc_server.engine.routes.common import EngineDep, check_label, page_bounds, str_metadata
from tinkerrpc_server.engine.sessions import SessionRecord
from tinkerrpc_server.engine.signed_urls import EXTERNAL_URL_TTL_SECONDS, check_trace_signature, sign_trace
from tinkerrpc_server.engine.storage import check_id
from tinkerrpc_server.engine.tokens import LOCAL_USER_URN

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter(prefix="/api/v1")

AccessScope = Literal["owned", "accessible"]


class FinishRequest(BaseModel):
    """The SDK's finish body (ServiceClient.close): how its client ended the session. Without a reason
    (or a body) the session finishes all the same, with no client finish recorded."""

    model_config = ConfigDict(extra="forbid")
    reason: types.ClientSessionFinishReason | None = None
    detail: str | None = None


class ProjectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")
    project_id: str = Field(min_length=1)


class TraceExportResponse(BaseModel):
    """The SDK's trace-export poll answer: the engine builds a trace at once, so it is always ready."""

    status: Literal["pending", "ready", "failed"]
    url: str | None = None
    error: str | None = None


def check_project(project_id: str | None) -> str | None:
    return None if project_id is None else check_id("project_id", project_id)


class CreateSessionBody(BaseModel):
    """The SDK's CreateSessionRequest with every field optional: a bare POST opens a session too (as it
    did before the engine kept session records), and fields of a later SDK are left unread."""

    tags: list[str] = []
    user_metadata: dict[str, object] | None = None
    sdk_version: str | None = None
    project_id: str | None = None
    display_name: str | None = None


@router.post("/create_session")
async def create_session(
    engine: EngineDep, body: CreateSessionBody | None = None
) -> types.CreateSessionResponse:
    request = body or CreateSessionBody()
    if len(request.tags) > MAX_ENGINE_LABELS:
        raise protocol.BadRequest(f"tags: at most {MAX_ENGINE_LABELS}, got {len(request.tags)}")
    record = SessionRecord(
        "",
        "",
        tags=[check_label("tags", tag) for tag in request.tags],
        user_metadata=str_metadata(request.user_metadata),
        project_id=check_project(request.project_id),
        display_name=None
        if request.display_name is None
        else check_label("display_name", request.display_name),
        sdk_version=None if request.sdk_version is None else check_label("sdk_version", request.sdk_version),
    )
    session_id = engine.records.open_session(record)
    log.info("session %s created", session_id)
    return types.CreateSessionResponse(session_id=session_id)


@router.post("/sessions/{session_id}/finish")
async def finish_session(
    session_id: str, engine: EngineDep, request: FinishRequest | None = None
) -> dict[str, str]:
    check_id("session_id", session_id)
    if request is not None and request.detail is not None:
        check_label("detail", request.detail)
    finish = None if request is None or request.reason is None else request.model_dump(mode="json")
    engine.finish_session(session_id, finish)
    return {}


# ---- views ----


def _status(view: SessionView) -> types.SessionStatus | None:
    if view.record.finish is not None:
        return types.ClientSessionFinished.model_validate({"type": "client_finished", **view.record.finish})
    return types.SessionActive() if view.running else None


def _summary(view: SessionView) -> types.SessionSummary:
    record = view.record
    return types.SessionSummary(
        session_id=record.session_id,
        created_at=datetime.fromisoformat(record.created_at),
        owner=LOCAL_USER_URN,
        project_id=record.project_id or "",
        status=_status(view),
        checkpoints_count=len(view.checkpoints),
        display_name=record.display_name,
        user_metadata=record.user_metadata or None,
        checkpoint_storage_bytes=sum(c.size_bytes for c in view.checkpoints),
    )


@router.get("/sessions")
async def list_sessions(
    engine: EngineDep, limit: int = 20, offset: int = 0, access_scope: AccessScope = "owned"
) -> types.ListSessionsResponse:
    selected = page_bounds(limit, offset)
    return types.ListSessionsResponse(sessions=engine.records.session_ids()[selected])


@router.get("/sessions/{session_id}")
async def get_session(
    session_id: str, engine: EngineDep, access_scope: AccessScope = "owned"
) -> types.GetSessionResponse:
    view = engine.records.session(check_id("session_id", session_id))
    return types.GetSessionResponse(
        training_run_ids=view.training_run_ids,
        sampler_ids=view.sampler_ids,
        user_metadata=view.record.user_metadata or None,
        display_name=view.record.display_name,
    )


def _matches(view: SessionView, request: types.SessionSearchRequest) -> bool:
    record = view.record
    named = request.session_id is not None or request.display_name is not None
    by_id = request.session_id is not None and record.session_id == request.session_id
    words = (request.display_name or "").lower().split()
    by_name = bool(words) and all(word in (record.display_name or "").lower() for word in words)
    if named and not (by_id or by_name):
        return False
    if request.project_ids is not None and record.project_id not in request.project_ids:
        return False
    if any(record.user_metadata.get(key) != value for key, value in request.user_metadata.items()):
        return False
    if isinstance(request.owner, types.UserSearchOwner) and LOCAL_USER_URN not in request.owner.owner_urns:
        return False
    return request.statuses is None or any(
        _status_matches(_status(view), query) for query in request.statuses
    )


def _status_matches(status: types.SessionStatus | None, query: types.SessionStatusQuery) -> bool:
    if status is None or status.type != query.type:
        return False
    if isinstance(query, types.ClientFinishedSessionStatusQuery) and query.reasons is not None:
        return isinstance(status, types.ClientSessionFinished) and status.reason.type in query.reasons
    return True


@router.post("/sessions/search")
async def search_sessions(
    request: types.SessionSearchRequest, engine: EngineDep
) -> types.SessionSearchResponse:
    """Newest first, `limit` per page; a page's cursor is its last session (created_at, session_id)."""
    if request.session_id is not None:
        check_id("session_id", request.session_id)
    if request.display_name is not None:
        check_label("display_name", request.display_name)
    if len(request.project_ids or ()) > MAX_ENGINE_LABELS:
        raise protocol.BadRequest(f"project_ids: at most {MAX_ENGINE_LABELS}")
    for project_id in request.project_ids or ():
        check_project(project_id)
    str_metadata(request.user_metadata)  # its bounds
    found = [v for v in engine.records.sessions() if _matches(v, request)]
    cursor = request.cursor
    if cursor is not None:
        after = (cursor.last_created_at, cursor.last_session_id)
        found = [
            v for v in found if (datetime.fromisoformat(v.record.created_at), v.record.session_id) < after
        ]
    page = found[: request.limit]
    last = page[-1].record if len(found) > request.limit else None
    return types.SessionSearchResponse(
        sessions=[_summary(v) for v in page],
        next_cursor=None
        if last is None
        else types.SessionSearchCursor(
            last_created_at=datetime.fromisoformat(last.created_at), last_session_id=last.session_id
        ),
    )


@router.put("/sessions/{session_id}/project")
async def assign_session_project(
    session_id: str, request: ProjectRequest, engine: EngineDep
) -> dict[str, str]:
    """Moving a session between projects is allowed; moving it out of one is not (the SDK's rule)."""
    engine.records.set_project(check_id("session_id", session_id), check_id("project_id", request.project_id))
    log.info("session %s moved to project %s", session_id, request.project_id)
    return {}


# ---- traces ----


def _request_log(request: Request) -> RequestLog:
    log_: RequestLog = request.app.state.request_log
    return log_


@router.get("/sessions/{session_id}/trace_export")
async def export_session_trace(session_id: str, request: Request, engine: EngineDep) -> TraceExportResponse:
    """A signed URL of the session's trace, built from the request log when it is downloaded."""
    engine.records.session(check_id("session_id", session_id))
    expires = int(time.time()) + EXTERNAL_URL_TTL_SECONDS
    signature = sign_trace(engine.url_secret, session_id, expires)
    base = str(request.base_url).rstrip("/")
    url = f"{base}/api/v1/session_traces/{session_id}.json?expires={expires}&signature={signature}"
    return TraceExportResponse(status="ready", url=url)


@router.get("/session_traces/{file}")
async def session_trace(
    file: str, request: Request, engine: EngineDep, expires: str = "", signature: str = ""
) -> Response:
    session_id = file.removesuffix(".json")
    check_trace_signature(engine.url_secret, session_id, expires, signature, time.time())
    trace = perfetto_trace(session_id, _request_log(request).entries(steps=True))
    headers = {"content-disposition": f'attachment; filename="{session_id}.json"'}
    return Response(trace, media_type="application/json", headers=headers)
