"""What the route families share: the engine dependency, future answers, SDK views of stored records."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from datetime import datetime, timezone
from typing import Annotated, Any

from fastapi import Depends, Request
from tinker import types

from tinkerrpc_server.engine.core import Engine
from tinkerrpc_server.engine.futures import Outcome
from tinkerrpc_server.engine.storage import CheckpointRecord


async def _engine(request: Request) -> Engine:
    # async: FastAPI runs a plain function dependency on its thread pool, a thread hop per request.
    engine: Engine = request.app.state.engine
    return engine


EngineDep = Annotated[Engine, Depends(_engine)]


def future(request_id: str, model_id: str | None = None) -> types.UntypedAPIFuture:
    return types.UntypedAPIFuture(request_id=request_id, model_id=model_id)


def model_operation(
    engine: Engine, model_id: str, seq_id: int | None, name: str, work: Callable[[], Outcome]
) -> types.UntypedAPIFuture:
    """Queue `work` in the live model's seq_id order. A request for a model this engine does not hold
    fails as a future, like the work's own errors."""
    if not engine.is_live(model_id):
        return future(engine.futures.failed(f"unknown model {model_id!r}"), model_id)
    return future(engine.submit_training(model_id, seq_id, name, work), model_id)


def str_metadata(value: Mapping[str, Any] | None) -> dict[str, str]:
    return {str(k): str(v) for k, v in (value or {}).items()}


def sdk_checkpoint(record: CheckpointRecord) -> types.Checkpoint:
    return types.Checkpoint(
        checkpoint_id=record.checkpoint_id,
        checkpoint_type=record.kind,
        time=datetime.fromisoformat(record.created_at),
        tinker_path=record.tinker_path,
        size_bytes=record.size_bytes,
        public=False,
        user_metadata=record.user_metadata or None,
        expires_at=None
        if record.expires_at is None
        else datetime.fromtimestamp(record.expires_at, timezone.utc),
    )
