"""Server-sent events, the one framing of every stream the sidecar answers.

The chunks come as the SampleStream RPC brings the tokens (sample_streams.py). A failure once the
stream has started (the server went away, the sampling failed) ends it with one `data:` frame holding
OpenAI's error object, as OpenAI's own streams do; closing the stream (the client left) closes the RPC,
and the engine stops decoding for it.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

from tinkerrpc import RPCError
from tinkerrpc_server.sidecar.errors import from_rpc_error

SSE_MEDIA_TYPE = "text/event-stream"


def sse_frame(data: str, event: str | None = None, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    kind = f"event: {event}\n" if event is not None else ""
    return f"{head}{kind}data: {data}\n\n"


async def _guarded(
    frames: AsyncIterator[str], close: Callable[[], Awaitable[None]], model: str, end: str | None
) -> AsyncIterator[str]:
    try:
        async for frame in frames:
            yield frame
        if end is not None:
            yield end
    except RPCError as error:
        yield sse_frame(json.dumps(from_rpc_error(error, model).body()))
    finally:
        await close()


ChunkT = TypeVar("ChunkT", bound=BaseModel)


def _openai_json(chunk: BaseModel) -> str:
    return chunk.model_dump_json(exclude_none=True)


async def _openai_frames(chunks: AsyncIterable[ChunkT], dump: Callable[[ChunkT], str]) -> AsyncIterator[str]:
    async for chunk in chunks:
        yield sse_frame(dump(chunk))


async def _typed_frames(events: AsyncIterable[dict[str, Any]]) -> AsyncIterator[str]:
    async for payload in events:
        yield sse_frame(json.dumps(payload), event=payload["type"])


def chunk_stream(
    chunks: AsyncIterable[ChunkT],
    close: Callable[[], Awaitable[None]],
    model: str,
    dump: Callable[[ChunkT], str] = _openai_json,
) -> StreamingResponse:
    """Chat, legacy completion and generate chunks, unnamed events ended by `data: [DONE]` as OpenAI and
    vLLM send them; `dump` writes a chunk's JSON (OpenAI's chunks leave out unset fields)."""
    frames = _guarded(_openai_frames(chunks, dump), close, model, sse_frame("[DONE]"))
    return StreamingResponse(frames, media_type=SSE_MEDIA_TYPE)


def typed_event_stream(
    events: AsyncIterable[dict[str, Any]], close: Callable[[], Awaitable[None]], model: str
) -> StreamingResponse:
    """Responses API events: each named by its `type`, with no end marker (the last event says so)."""
    return StreamingResponse(_guarded(_typed_frames(events), close, model, None), media_type=SSE_MEDIA_TYPE)
