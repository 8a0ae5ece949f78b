"""Checkpoints shared beyond their run: copy_weights (ServiceClient and RestClient) and publishing.

Local meanings (Tinker's are across accounts; the engine has one principal, whoever holds its key):
- a copy is a new training run, which no client trains, holding the checkpoint under the same kind and
  name; its files are hard links to the source's, so no bytes are duplicated and deleting either one
  leaves the other whole. Its run is `<session>:train:<model_seq_id>` of the session the request names,
  else run 0 of a new session (finished at once) in `destination_project_id`;
- a published checkpoint is listed `public` (and stays so across restarts) until it is unpublished;
  every checkpoint is already readable by the one principal, so publishing opens nothing to anyone
  without the key. Publishing a public checkpoint, or unpublishing a private one, is refused with a 400
  (Tinker's is a 409, which the SDK retries for 5 minutes before it raises: a 400 raises at once).
- a weights access token reads another account's weights: there is none here, so one is refused.
"""

from __future__ import annotations

import logging
from typing import Annotated

from fastapi import APIRouter, Header
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinkerrpc.contract.limits import MAX_IDEMPOTENCY_KEY_BYTES, MAX_INT32
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.checkpoints import expiry
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.storage import check_id

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter(prefix="/api/v1")


def refuse_access_token(token: str | None) -> None:
    """A weights access token names another account's weights; the engine has one principal."""
    if token is not None:
        raise protocol.BadRequest(
            "weights_access_token: this engine has one principal, who reads every checkpoint with its key; "
            "omit the token"
        )


def model_seq_target(session_id: str | None, model_seq_id: int | None) -> tuple[str, int] | None:
    """The (session, model_seq_id) a request names, both or neither, each checked."""
    if (session_id is None) != (model_seq_id is None):
        raise protocol.BadRequest("session_id and model_seq_id go together: give both or neither")
    if session_id is None or model_seq_id is None:
        return None
    if not 0 <= model_seq_id <= MAX_INT32:
        raise protocol.BadRequest(f"model_seq_id must be 0 to {MAX_INT32}, got {model_seq_id}")
    return check_id("session_id", session_id), model_seq_id


@router.post("/copy_weights")
async def copy_weights(
    request: types.CopyWeightsRequest,
    engine: EngineDep,
    x_idempotency_key: Annotated[str | None, Header()] = None,
    x_tinker_weights_access_token: Annotated[str | None, Header()] = None,
) -> types.CopyWeightsResponse:
    refuse_access_token(request.weights_access_token or x_tinker_weights_access_token)
    target = model_seq_target(request.session_id, request.model_seq_id)
    project_id = request.destination_project_id
    if (target is None) == (project_id is None):
        raise protocol.BadRequest("give destination_project_id, or session_id and model_seq_id (not both)")
    if project_id is not None:
        check_id("destination_project_id", project_id)
    if x_idempotency_key is not None and len(x_idempotency_key.encode()) > MAX_IDEMPOTENCY_KEY_BYTES:
        raise protocol.BadRequest(f"X-Idempotency-Key: at most {MAX_IDEMPOTENCY_KEY_BYTES} bytes")
    expires_at = expiry(request.ttl_seconds)
    path = await run_in_threadpool(
        engine.records.copy_checkpoint, request.source_path, target, project_id, expires_at, x_idempotency_key
    )
    log.info("copied %s to %s", request.source_path, path)
    return types.CopyWeightsResponse(tinker_path=path)


# Segments spelled out (not one `:path` parameter): a checkpoint named "publish" is no publish request.
_PUBLISH_PATH = "/training_runs/{model_id}/checkpoints/{segment}/{name}/publish"


@router.post(_PUBLISH_PATH)
async def publish_checkpoint(model_id: str, segment: str, name: str, engine: EngineDep) -> dict[str, str]:
    record = engine.records.set_public(f"tinker://{model_id}/{segment}/{name}", True)
    log.info("checkpoint %s published", record.tinker_path)
    return {}


@router.delete(_PUBLISH_PATH)
async def unpublish_checkpoint(model_id: str, segment: str, name: str, engine: EngineDep) -> dict[str, str]:
    record = engine.records.set_public(f"tinker://{model_id}/{segment}/{name}", False)
    log.info("checkpoint %s unpublished", record.tinker_path)
    return {}
