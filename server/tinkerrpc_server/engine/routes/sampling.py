"""Sampling: sampling sessions and asample, whose requests for the same weights run as one batch; and the
engine extension `GET /api/v1/sampled_sequences/{sequence_id}`, which says which weights produced which
tokens of a sampled sequence (Tinker's responses do not say; docs/tinker_parity.md)."""

from __future__ import annotations

import logging

import pydantic
from fastapi import APIRouter
from starlette.concurrency import run_in_threadpool
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.core import NotFound
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.sampled import UnknownSequence
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
    await run_in_threadpool(engine.open_sampling_session, sampler_id, model_path, request.base_model)
    log.info("sampling session %s on %s", sampler_id, model_path or request.base_model)
    return types.CreateSamplingSessionResponse(sampling_session_id=sampler_id)


@router.get("/samplers/{sampler_id}")
async def get_sampler(sampler_id: str, engine: EngineDep) -> types.GetSamplerResponse:
    sampler = engine.sampler(sampler_id)
    return types.GetSamplerResponse(
        sampler_id=sampler_id, base_model=sampler.base_model, model_path=sampler.model_path
    )


class WeightsSpanInfo(pydantic.BaseModel):
    """`length` sampled tokens from `start` came from these weights: a checkpoint's (None: the base
    model) and, for an inflight sampling client, the version of its training client's inflight weights."""

    start: int
    length: int
    model_path: str | None
    weights_version: int | None


class SampledSequenceInfo(pydantic.BaseModel):
    sequence_id: str
    prompt_tokens: int
    sampled_tokens: int
    weights: list[WeightsSpanInfo]
    stability_info_recorded: bool


@router.get("/sampled_sequences/{sequence_id}")
async def sampled_sequence(sequence_id: str, engine: EngineDep) -> SampledSequenceInfo:
    try:
        record = engine.sampled.get(sequence_id)
    except UnknownSequence as exc:
        raise NotFound(str(exc)) from exc
    return SampledSequenceInfo(
        sequence_id=sequence_id,
        prompt_tokens=len(record.prompt),
        sampled_tokens=len(record.tokens),
        weights=[
            WeightsSpanInfo(
                start=s.start, length=s.length, model_path=s.model_path, weights_version=s.version
            )
            for s in record.weights
        ],
        stability_info_recorded=record.stability is not None,
    )


@router.post("/asample")
async def asample(request: types.SampleRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    try:
        sampler = engine.sampler_for(request.sampling_session_id, request.model_path, request.base_model)
        job = protocol.sample_job(request)
    except (protocol.BadRequest, NotFound, UnknownPathError, InvalidNameError) as exc:
        request_id = engine.failed_request(str(exc))
    else:
        request_id = engine.submit_sample(sampler, job)
    return types.UntypedAPIFuture(
        request_id=request_id,
        sample_sequence_ids=[f"{request_id}:{i}" for i in range(request.num_samples)],
    )
