"""What the route families share: the engine dependency, future answers, the wire form of an outcome,
SDK views of stored records."""

from __future__ import annotations

import logging
from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import Depends, Request
from fastapi.responses import JSONResponse, Response
from tinker import types

from tinkerrpc.contract.limits import (
    MAX_ENGINE_LABEL_CHARS,
    MAX_ENGINE_LABELS,
    MAX_ENGINE_PAGE_SIZE,
    MAX_INT32,
)
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.answers import Answer
from tinkerrpc_server.engine.compute.samples import SampleOutput
from tinkerrpc_server.engine.core import Engine
from tinkerrpc_server.engine.futures import FailedResult, Outcome
from tinkerrpc_server.engine.runtime import ForwardResult
from tinkerrpc_server.engine.storage import CheckpointRecord

log = logging.getLogger("tinkerrpc.engine")


async def _engine(request: Request) -> Engine:
    # async: FastAPI runs a plain function dependency on its thread pool, a thread hop per request.
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(_engine)]


def future(request_id: str, model_id: str | None = None) -> types.UntypedAPIFuture:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)


def model_operation(
    engine: Engine, model_id: str, seq_id: int | None, name: str, work: Callable[[], Answer]
) -> types.UntypedAPIFuture:
    """Queue `work` in the live model's seq_id order (Engine.submit_to_live_model)."""
    return future(engine.submit_to_live_model(model_id, seq_id, name, work), model_id)


def _failed(message: str, category: types.RequestErrorCategory) -> JSONResponse:
    failed = types.RequestFailedResponse(error=message, category=category)
    return JSONResponse(failed.model_dump(mode="json"))


def outcome_response(outcome: Outcome[Answer]) -> Response:
    """A finished request's outcome as the SDK reads it: sample and forward results as protobuf, every
    other answer as its JSON, a failure as RequestFailedResponse."""
    if isinstance(outcome, FailedResult):
        return _failed(outcome.message, types.RequestErrorCategory(outcome.category))
    if isinstance(outcome, SampleOutput):
        return Response(protocol.encode_sample_output(outcome), media_type=protocol.PROTOBUF_CONTENT_TYPE)
    if isinstance(outcome, ForwardResult):
        return Response(protocol.encode_forward_result(outcome), media_type=protocol.PROTOBUF_CONTENT_TYPE)
    try:
        return JSONResponse(outcome.model_dump(mode="json"))
    except ValueError as error:
        # A non-finite number: answered as a failure the SDK reports, not an HTTP 500 it retries forever.
        message = f"{type(outcome).__name__} holds a value JSON cannot carry ({error})"
        log.error("a result cannot be sent: %s", message)
        return _failed(message, types.RequestErrorCategory("server"))


def str_metadata(value: Mapping[str, Any] | None, field: str = "user_metadata") -> dict[str, str]:
    """A user_metadata as strings, refused (naming `field`) past MAX_ENGINE_LABELS entries or with a key
    or value past MAX_ENGINE_LABEL_CHARS."""
    metadata = {str(k): str(v) for k, v in (value or {}).items()}
    if len(metadata) > MAX_ENGINE_LABELS:
        raise protocol.BadRequest(f"{field}: at most {MAX_ENGINE_LABELS} entries, got {len(metadata)}")
    for key, text in metadata.items():
        check_label(f"{field}[{key[:40]!r}]", key)
        check_label(f"{field}[{key[:40]!r}]", text)
    return metadata


def check_label(field: str, text: str) -> str:
    """`text` unless it is longer than MAX_ENGINE_LABEL_CHARS (protocol.BadRequest naming `field`)."""
    if len(text) > MAX_ENGINE_LABEL_CHARS:
        raise protocol.BadRequest(f"{field}: at most {MAX_ENGINE_LABEL_CHARS} characters, got {len(text)}")
    return text


def page_bounds(limit: int, offset: int) -> slice:
    """The slice a listing's `limit` and `offset` select, refused outside 1..MAX_ENGINE_PAGE_SIZE and
    0..MAX_INT32."""
    if not 1 <= limit <= MAX_ENGINE_PAGE_SIZE:
        raise protocol.BadRequest(f"limit must be 1 to {MAX_ENGINE_PAGE_SIZE}, got {limit}")
    if not 0 <= offset <= MAX_INT32:
        raise protocol.BadRequest(f"offset must be 0 to {MAX_INT32}, got {offset}")
    return slice(offset, offset + limit)


def sdk_checkpoint(record: CheckpointRecord) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=record.checkpoint_id,
        checkpoint_type=record.kind,
        time=datetime.fromisoformat(record.created_at),
        tinker_path=record.tinker_path,
        size_bytes=record.size_bytes,
        public=record.public,
        user_metadata=record.user_metadata or None,
        expires_at=None
        if record.expires_at is None
        else datetime.fromtimestamp(record.expires_at, timezone.utc),
    )
