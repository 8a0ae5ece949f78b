"""Sampling: sampling sessions and asample, whose requests for the same weights run as one batch."""

from __future__ import annotations

import logging

from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.core import NotFound
from tinkerrpc_server.engine.futures import FailedResult
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.storage import InvalidNameError, UnknownPathError, check_id

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter(prefix="/api/v1")


@router.post("/create_sampling_session")
async def create_sampling_session(
    request: types.CreateSamplingSessionRequest, engine: EngineDep
) -> types.CreateSamplingSessionResponse:
    check_id("session_id", request.session_id)
    engine.require_open_session(request.session_id)
    sampler_id = check_id(
        "sampling_session_id", f"{request.session_id}:sample:{request.sampling_session_seq_id}"
    )
    model_path = request.model_path or None
    if model_path is not None:
        record, _ = engine.storage.resolve(model_path)
        base_model = engine.storage.get_run(record.model_id).base_model
    elif request.base_model is None:
        raise protocol.BadRequest("base_model is required")
    else:
        base_model = request.base_model
        await run_in_threadpool(engine.resolve_model_dir, base_model)
    engine.new_sampler(sampler_id, base_model, model_path)
    log.info("sampling session %s on %s", sampler_id, model_path or base_model)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, engine: EngineDep) -> types.GetSamplerResponse:
    sampler = engine.sampler(sampler_id)
    return types.GetSamplerResponse(
        sampler_id=sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
    )


@router.post("/asample")
async def asample(request: types.SampleRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    request_id, result = engine.futures.create()
    response = types.UntypedAPIFuture(
        request_id=request_id,
        sample_sequence_ids=[f"{request_id}:{i}" for i in range(request.num_samples)],
    )
    try:
        sampler = engine.sampler_for(request.sampling_session_id, request.model_path, request.base_model)
        job = protocol.sample_job(request)
    except (protocol.BadRequest, NotFound, UnknownPathError, InvalidNameError) as exc:
        result.set_result(FailedResult(str(exc), "user"))
        return response
    engine.submit_sample(sampler, job, result)
    return response
