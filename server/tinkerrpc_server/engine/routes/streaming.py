"""The engine's token stream: an extension beside Tinker's HTTP API (Tinker has no streaming). POST a
`tinker.types.SampleRequest` to SAMPLE_STREAM_PATH, with the X-API-Key every route needs, and read NDJSON
lines as the tokens are sampled (token_stream_wire.py says what each line holds). The request joins
the same continuously batched decode as asample's; a client that disconnects (or reads too slowly)
frees its rows at the next decode step."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import replace

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.core import Engine
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.token_streams import StreamSlots, TokenStream, outcome_line, tokens_line
from tinkerrpc_server.token_stream_wire import NDJSON_MEDIA_TYPE, SAMPLE_STREAM_PATH, failed_line

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter()

# A stream lasts as long as its sample; its outcome is awaited in stretches of this many seconds.
_OUTCOME_WAIT_SECONDS = 3600.0


async def _never() -> None:
    await asyncio.Event().wait()


@router.post(SAMPLE_STREAM_PATH, response_model=None)
async def sample_stream(request: types.SampleRequest, http: Request, engine: EngineDep) -> Response:
    slots: StreamSlots = http.app.state.token_streams
    sampler = engine.sampler_for(request.sampling_session_id, request.model_path, request.base_model)
    job = protocol.sample_job(request)
    if not slots.acquire():
        return JSONResponse(
            {"detail": f"{slots.limit} token streams are open (MAX_ENGINE_TOKEN_STREAMS): try again later"},
            status_code=429,
        )
    stream = TokenStream(asyncio.get_running_loop())
    try:
        request_id = engine.submit_sample(sampler, replace(job, on_token=stream.push))
    except BaseException:
        slots.release()
        raise
    stream.on_overflow = lambda: engine.abandon(request_id)
    return StreamingResponse(_lines(engine, request_id, stream, slots), media_type=NDJSON_MEDIA_TYPE)


async def _lines(
    engine: Engine, request_id: str, stream: TokenStream, slots: StreamSlots
) -> AsyncIterator[bytes]:
    outcome = asyncio.ensure_future(engine.outcome(request_id, _OUTCOME_WAIT_SECONDS, _never))
    finished = False
    try:
        while True:
            arrived = asyncio.ensure_future(stream.arrived())
            await asyncio.wait({outcome, arrived}, return_when=asyncio.FIRST_COMPLETED)
            arrived.cancel()
            # Every token of a request is pushed before its outcome is set (same thread, in order).
            events = stream.take()
            if events:
                yield tokens_line(events)
            if stream.overflowed:
                yield failed_line(
                    "the stream's reader fell too far behind (MAX_STREAM_BUFFERED_TOKENS)", "user"
                )
                return
            if outcome.done():
                answer = outcome.result()
                if answer is None:  # still decoding after a whole wait: wait again
                    outcome = asyncio.ensure_future(engine.outcome(request_id, _OUTCOME_WAIT_SECONDS, _never))
                    continue
                finished = True
                yield outcome_line(answer)
                return
    finally:
        slots.release()
        outcome.cancel()
        if not finished:
            # The client left (or fell behind): its rows stop decoding at the next step.
            engine.abandon(request_id)
            log.info("sample stream %s: its reader left; its rows stop decoding", request_id)
