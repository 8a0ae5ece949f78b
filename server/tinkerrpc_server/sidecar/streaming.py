"""Server-sent events, the one framing of every stream the sidecar answers.

The Sample RPC is unary, so an endpoint's stream replays a finished result: the first token arrives
only after the whole sample, and the chunks exist for client compatibility, not latency.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Iterator
from typing import Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel

SSE_MEDIA_TYPE = "text/event-stream"


def sse_frame(data: str, event: str | None = None, event_id: int | None = None) -> str:
    head = f"id: {event_id}\n" if event_id is not None else ""
    kind = f"event: {event}\n" if event is not None else ""
    return f"{head}{kind}data: {data}\n\n"


def _openai_frames(chunks: Iterable[BaseModel]) -> Iterator[str]:
    for chunk in chunks:
        yield sse_frame(chunk.model_dump_json(exclude_none=True))
    yield sse_frame("[DONE]")


def _typed_frames(events: Iterable[dict[str, Any]]) -> Iterator[str]:
    for payload in events:
        yield sse_frame(json.dumps(payload), event=payload["type"])


def chunk_stream(chunks: Iterable[BaseModel]) -> StreamingResponse:
    """Chat and legacy completion chunks, unnamed events ended by `data: [DONE]` as OpenAI sends them."""
    return StreamingResponse(_openai_frames(chunks), media_type=SSE_MEDIA_TYPE)


def typed_event_stream(events: Iterable[dict[str, Any]]) -> StreamingResponse:
    """Responses API events: each named by its `type`, with no end marker (the last event says so)."""
    return StreamingResponse(_typed_frames(events), media_type=SSE_MEDIA_TYPE)
