"""Weights and checkpoints: save (state, for sampler, external), load, describe, list, delete, download.

External weights (save_weights_external) are plain PEFT adapter directories; get_external_weights_urls
hands out one signed URL per file (see signed_urls), served by this engine under
/api/v1/external_weights_files/.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections.abc import Callable
from datetime import datetime, timezone
from urllib.parse import quote

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.age_export import parse_recipients
from tinkerrpc_server.engine.answers import Answer
from tinkerrpc_server.engine.optimizers import optimizer_family, saved_optimizer_config
from tinkerrpc_server.engine.routes.common import (
    EngineDep,
    future,
    model_operation,
    page_bounds,
    sdk_checkpoint,
    str_metadata,
)
from tinkerrpc_server.engine.routes.sharing import model_seq_target, refuse_access_token
from tinkerrpc_server.engine.runtime import EngineUserError
from tinkerrpc_server.engine.signed_urls import EXTERNAL_URL_TTL_SECONDS, check_file_signature, sign_file
from tinkerrpc_server.engine.storage import check_id, check_relative_path, file_inside, regular_files

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter(prefix="/api/v1")

# ---- saving and loading (operations on a model's queue) ----


@router.post("/save_weights")
async def save_weights(request: types.SaveWeightsRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    model_id = request.model_id
    name = request.path or f"state-{request.seq_id or secrets.token_hex(4)}"

    def work() -> Answer:
        record = engine.save_checkpoint(
            model_id,
            "training",
            name,
            request.overwrite,
            str_metadata(request.user_metadata),
            request.ttl_seconds,
        )
        return types.SaveWeightsResponse(path=record.tinker_path, type="save_weights")

    return model_operation(engine, model_id, request.seq_id, "save_weights", work)


@router.post("/save_weights_for_sampler")
async def save_weights_for_sampler(
    request: types.SaveWeightsForSamplerRequest, engine: EngineDep
) -> types.UntypedAPIFuture:
    model_id = request.model_id

    def work() -> Answer:
        # The no-name variant hands back a sampling session over the weights just saved.
        if request.path and request.kind == "inflight":
            raise EngineUserError("kind 'inflight' saves have no name: an inflight target is unnamed")
        record, sampling_session_id = engine.save_for_sampler(
            model_id,
            request.path,
            request.seq_id,
            request.sampling_session_seq_id,
            str_metadata(request.user_metadata),
            request.ttl_seconds,
            request.kind,
        )
        return types.SaveWeightsForSamplerResponseInternal(
            path=record.tinker_path, sampling_session_id=sampling_session_id, type="save_weights_for_sampler"
        )

    return model_operation(engine, model_id, request.seq_id, "save_weights_for_sampler", work)


@router.post("/save_weights_external")
async def save_weights_external(
    request: types.SaveWeightsExternalRequest, engine: EngineDep
) -> types.UntypedAPIFuture:
    model_id = request.model_id

    def work() -> Answer:
        # Checked here, in seq order, so a rejected request still takes its turn in the model's queue.
        recipients = None
        if request.age_encryption_recipients is not None:
            recipients = parse_recipients(request.age_encryption_recipients)
        record = engine.save_checkpoint(model_id, "external", request.path, False, {}, request.ttl_seconds)
        if recipients is not None:
            record = engine.records.encrypt_external(record.tinker_path, recipients)
        return types.SaveWeightsExternalResponseInternal(
            path=record.tinker_path, size_bytes=record.size_bytes, type="save_weights_external"
        )

    return model_operation(engine, model_id, request.seq_id, "save_weights_external", work)


@router.post("/load_weights")
async def load_weights(request: types.LoadWeightsRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    optimizer = optimizer_family(request.optimizer_config)

    def load_into(model_id: str) -> Callable[[], Answer]:
        def work() -> Answer:
            try:  # refused in its turn: a live model's refused load keeps its seq_id, leaving no gap
                refuse_access_token(request.weights_access_token)
            except protocol.BadRequest as refused:
                raise EngineUserError(str(refused)) from None
            metadata = str_metadata(request.user_metadata)
            trained_on = engine.run_of_checkpoint(request.path).base_model
            if request.base_model not in (None, trained_on):
                raise EngineUserError(
                    f"base_model {request.base_model!r} is not {trained_on!r}, which {request.path} was "
                    "trained on (the engine has no compatible variants of a base model to load it into)"
                )
            engine.load_weights(
                model_id, request.path, request.base_model, request.optimizer, metadata, optimizer
            )
            return types.LoadWeightsResponse(path=request.path, model_id=model_id, type="load_weights")

        return work

    if request.model_id is not None:
        if request.session_id is not None or request.model_seq_id is not None:
            raise protocol.BadRequest("load_weights takes model_id, or session_id and model_seq_id, not both")
        return model_operation(
            engine, request.model_id, request.seq_id, "load_weights", load_into(request.model_id)
        )
    refuse_access_token(request.weights_access_token)  # before create-via-load makes anything
    target = model_seq_target(request.session_id, request.model_seq_id)
    if target is None:
        raise protocol.BadRequest("load_weights needs model_id, or session_id and model_seq_id")
    # Create-via-load: the load is the new model's first request, made in an open session like
    # create_model (a finished session's models are never freed), of a model that does not exist yet.
    engine.require_open_session(target[0])
    model_id = check_id("model_id", f"{target[0]}:train:{target[1]}")
    resent = engine.resent_request(model_id, 0, "load_weights")
    if resent is not None:
        return future(resent, model_id)
    if engine.is_live(model_id) or model_id in {run.model_id for run in engine.runs()}:
        return future(engine.failed_request(f"model {model_id} already exists"), model_id)
    return future(engine.submit_training(model_id, 0, "load_weights", load_into(model_id)), model_id)


@router.post("/weights_info")
async def weights_info(request: protocol.WeightsInfoRequest, engine: EngineDep) -> types.WeightsInfoResponse:
    run = engine.run_of_checkpoint(request.tinker_path)
    optimizer = await run_in_threadpool(
        saved_optimizer_config, engine.records.checkpoint_dir(request.tinker_path)
    )
    return types.WeightsInfoResponse(
        base_model=run.base_model,
        optimizer_config=optimizer,
        is_lora=True,
        lora_rank=run.lora_rank,
        train_unembed=run.train_unembed,
        train_mlp=run.train_mlp,
        train_attn=run.train_attn,
    )


# ---- checkpoints (REST) ----


@router.get("/training_runs/{model_id}/checkpoints")
async def list_checkpoints(model_id: str, engine: EngineDep) -> types.CheckpointsListResponse:
    engine.run(model_id)
    return types.CheckpointsListResponse(
        checkpoints=[sdk_checkpoint(c) for c in engine.checkpoints(model_id)]
    )


@router.delete("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
async def delete_checkpoint(model_id: str, checkpoint_id: str, engine: EngineDep) -> dict[str, str]:
    await run_in_threadpool(engine.delete_checkpoint, model_id, checkpoint_id)
    return {}


@router.put("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/ttl")
async def set_checkpoint_ttl(
    model_id: str, checkpoint_id: str, request: protocol.CheckpointTtlRequest, engine: EngineDep
) -> dict[str, str]:
    """The SDK's set_checkpoint_ttl_from_tinker_path: expire `ttl_seconds` from now, or never (None)."""
    engine.set_checkpoint_ttl(model_id, checkpoint_id, request.ttl_seconds)
    return {}


@router.get("/checkpoints")
async def list_all_checkpoints(
    engine: EngineDep, limit: int = 100, offset: int = 0
) -> types.CheckpointsListResponse:
    selected = page_bounds(limit, offset)
    everything = [c for r in engine.runs() for c in engine.checkpoints(r.model_id)]
    return types.CheckpointsListResponse(
        checkpoints=[sdk_checkpoint(c) for c in everything[selected]],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=len(everything)),
    )


# ---- external weights downloads ----


# The SDK sends checkpoint_id ("external_weights/<name>") with its slash unencoded.
@router.get("/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
async def external_weights_urls(
    model_id: str, checkpoint_id: str, request: Request, engine: EngineDep
) -> types.ExternalWeightsUrlsResponse:
    record, directory = engine.external_weights(model_id, checkpoint_id)
    files = await run_in_threadpool(regular_files, directory)
    expires = int(time.time()) + EXTERNAL_URL_TTL_SECONDS
    base = f"{str(request.base_url).rstrip('/')}/api/v1/external_weights_files"
    prefix = f"{base}/{quote(model_id, safe=':')}/{quote(record.name, safe='')}"
    urls = {
        file: f"{prefix}/{quote(file)}?expires={expires}&signature="
        + sign_file(engine.url_secret, model_id, record.name, file, expires)
        for file in files
    }
    return types.ExternalWeightsUrlsResponse(urls=urls, expires=datetime.fromtimestamp(expires, timezone.utc))


@router.get("/external_weights_files/{model_id}/{name}/{file:path}")
async def external_weights_file(
    model_id: str, name: str, file: str, engine: EngineDep, expires: str = "", signature: str = ""
) -> FileResponse:
    check_relative_path(file)  # 404 for '..', absolute paths and the like, before anything else
    check_file_signature(engine.url_secret, model_id, name, file, expires, signature, time.time())
    _, directory = engine.external_weights(model_id, f"external_weights/{name}")
    path = await run_in_threadpool(file_inside, directory, file)
    return FileResponse(path, media_type="application/octet-stream")
