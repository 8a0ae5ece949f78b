"""The engine's token stream on the wire, written once for the engine that sends it and the service that
reads it: an extension beside Tinker's HTTP API (Tinker has no streaming; docs/engine.md).

POST a `tinker.types.SampleRequest` (JSON) to SAMPLE_STREAM_PATH with the engine's X-API-Key; the answer
is NDJSON, one JSON object per line:
- `{"tokens": [{"sample": i, "token": t, "logprob": lp, "top": [ids, logprobs] | null,
  "stop_reason": "stop" | "length" | null}, ...]}`: tokens sampled since the previous line, each sample's
  in order; a sample's last token carries its stop reason;
- last, `{"done": {"sequences": [{"tokens", "logprobs", "stop_reason"}], "prompt_logprobs": [...] | null}}`,
  the whole result as asample answers it, or `{"error": message, "category": "user" | "server"}`.
A request refused before it starts is answered with an HTTP error and `{"detail": message}`, as asample's
routes answer.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

SAMPLE_STREAM_PATH = "/api/v1/tinkerrpc/sample_stream"
NDJSON_MEDIA_TYPE = "application/x-ndjson"

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class StreamedToken:
    sample: int
    token: int
    logprob: float
    top: tuple[list[int], list[float]] | None  # when the request asks for topk_sample_logprobs
    stop_reason: StopReason | None  # set on a sample's last token


@dataclass(frozen=True)
class StreamedSequence:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason


@dataclass(frozen=True)
class StreamDone:
    sequences: list[StreamedSequence]
    prompt_logprobs: list[float | None] | None


@dataclass(frozen=True)
class StreamFailed:
    message: str
    category: str  # "user" or "server", as tinker's RequestErrorCategory


StreamLine = list[StreamedToken] | StreamDone | StreamFailed


def _line(payload: dict[str, Any]) -> bytes:
    return (json.dumps(payload, separators=(",", ":")) + "\n").encode()


def tokens_line(tokens: Sequence[StreamedToken]) -> bytes:
    return _line(
        {
            "tokens": [
                {
                    "sample": t.sample,
                    "token": t.token,
                    "logprob": t.logprob,
                    "top": None if t.top is None else [t.top[0], t.top[1]],
                    "stop_reason": t.stop_reason,
                }
                for t in tokens
            ]
        }
    )


def done_line(done: StreamDone) -> bytes:
    return _line(
        {
            "done": {
                "sequences": [
                    {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                    for s in done.sequences
                ],
                "prompt_logprobs": done.prompt_logprobs,
            }
        }
    )


def failed_line(message: str, category: str) -> bytes:
    return _line({"error": message, "category": category})


def parse_line(line: str | bytes) -> StreamLine:
    """One line of the stream; ValueError (with what was wrong) for anything else."""
    try:
        payload = json.loads(line)
        if "tokens" in payload:
            return [
                StreamedToken(
                    int(t["sample"]),
                    int(t["token"]),
                    float(t["logprob"]),
                    None
                    if t["top"] is None
                    else ([int(i) for i in t["top"][0]], [float(v) for v in t["top"][1]]),
                    t["stop_reason"],
                )
                for t in payload["tokens"]
            ]
        if "done" in payload:
            done = payload["done"]
            return StreamDone(
                [
                    StreamedSequence(
                        [int(t) for t in s["tokens"]], [float(v) for v in s["logprobs"]], s["stop_reason"]
                    )
                    for s in done["sequences"]
                ],
                done["prompt_logprobs"],
            )
        return StreamFailed(str(payload["error"]), str(payload["category"]))
    except (ValueError, KeyError, TypeError, IndexError) as err:
        raise ValueError(f"not a token stream line ({err!r}): {line[:200]!r}") from err
