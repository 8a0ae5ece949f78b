"""The SDK's AdminClient (and RestClient's deprecated copies of it): the audit log, billing usage and
checkpoint storage usage, answered truthfully for a local engine.

- Audit log: the engine's own request log (engine/request_log.py) for one UTC day, filtered by the
  SDK's event types (checkpoints, projects; teams and organizations have no events here). Training
  steps and samples are left to session traces.
- Billing: the engine bills nothing, so a well-formed window has no billing events and no cost.
- Storage: the bytes the live checkpoints' files hold on the data dir, each stored file once (a copy's
  hard links share its source's), by project; at no cost.
"""

from __future__ import annotations

from datetime import date, datetime, timedelta, timezone
from typing import Literal

from fastapi import APIRouter, Request
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.request_log import RequestLog, audit_entries, utc
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.storage import check_id
from tinkerrpc_server.engine.tokens import LOCAL_USER_URN

router = APIRouter(prefix="/api/v1")

# The SDK's bound on a billing window (GetBillingUsageRequest.ending_before).
MAX_BILLING_WINDOW = timedelta(days=14)
# Bytes per unit of the storage billing unit (size_gigabytes).
BYTES_PER_GIGABYTE = 1e9
# The SDK's event types (request_log.EVENT_TYPES says what each covers).
AuditEventType = Literal["all", "checkpoints", "projects", "teams", "organizations"]


def _audit_entry(entry_time: float, event: str, details: dict[str, object]) -> types.AuditLogEntry:
    checkpoint = event.startswith("checkpoint_")
    return types.AuditLogEntry(
        timestamp=utc(entry_time),
        event=event,
        event_details=details,
        model_id=str(details["model_id"]) if checkpoint and "model_id" in details else None,
        tinker_path=str(details["tinker_path"]) if checkpoint and "tinker_path" in details else None,
        purpose=event.removeprefix("checkpoint_") if checkpoint else None,
    )


@router.get("/audit")
async def audit_log(
    request: Request, event_type: AuditEventType = "all", day: date | None = None
) -> types.AuditLogResponse:
    day = day or datetime.now(timezone.utc).date()
    day_start = datetime(day.year, day.month, day.day, tzinfo=timezone.utc).timestamp()
    log: RequestLog = request.app.state.request_log
    entries = audit_entries(log, event_type, day_start)
    return types.AuditLogResponse(entries=[_audit_entry(e.at, e.event, e.details()) for e in entries])


def _hour_aligned(name: str, value: datetime) -> datetime:
    if value.tzinfo is None:
        raise protocol.BadRequest(f"{name} must carry a time zone (RFC 3339), got {value.isoformat()}")
    if (value.minute, value.second, value.microsecond) != (0, 0, 0):
        raise protocol.BadRequest(f"{name} must be aligned to a UTC hour boundary, got {value.isoformat()}")
    return value


@router.get("/billing/usage/events")
async def billing_usage(starting_on: datetime, ending_before: datetime) -> types.BillingUsageResponse:
    start = _hour_aligned("starting_on", starting_on)
    end = _hour_aligned("ending_before", ending_before)
    if start > datetime.now(timezone.utc):
        raise protocol.BadRequest(f"starting_on must not be in the future, got {start.isoformat()}")
    if not start < end <= start + MAX_BILLING_WINDOW:
        raise protocol.BadRequest("ending_before must be after starting_on and at most 14 days after it")
    return types.BillingUsageResponse(data=[], sessions={}, cost_data_through=None)


@router.get("/billing/usage/checkpoints/current")
async def checkpoint_storage_usage(
    engine: EngineDep, project_id: str | None = None
) -> types.CurrentCheckpointStorageUsageResponse:
    if project_id is not None:
        check_id("project_id", project_id)
    usage = await run_in_threadpool(engine.records.storage_use)
    return types.CurrentCheckpointStorageUsageResponse(
        effective_rate_usd_per_gigabyte_month=0.0,
        data=[
            types.CurrentCheckpointStorageUsageItem(
                project_id=use.project_id,
                org_user_urn=LOCAL_USER_URN,
                checkpoint_count=use.checkpoint_count,
                size_bytes=use.size_bytes,
                size_gigabytes=use.size_bytes / BYTES_PER_GIGABYTE,
                estimated_monthly_cost_usd=0.0,
            )
            for use in usage
            if project_id is None or use.project_id == project_id
        ],
    )
