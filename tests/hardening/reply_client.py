"""The hosted sidecar's chat replies as the tests compare them: one shape for a plain answer and for a
stream's chunks put back together, so each case is checked both ways."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import httpx
from hardening_support import SIDECAR_KEY
from service.svc import CALL_TIMEOUT

HEADERS = {"authorization": f"Bearer {SIDECAR_KEY}", "content-type": "application/json"}


@dataclass
class Reply:
    """One choice of a chat completion: its content, calls as (name, arguments), finish reason, token ids
    and the prompt's; a stream's content pieces too (one per content delta)."""

    content: str | None
    calls: list[tuple[str, Any]]
    finish_reason: str | None
    token_ids: list[int]
    prompt_token_ids: list[int]
    pieces: list[str] = field(default_factory=list)


def chat(sidecar: str, body: dict[str, Any]) -> httpx.Response:
    return httpx.post(f"{sidecar}/v1/chat/completions", json=body, headers=HEADERS, timeout=CALL_TIMEOUT)


def plain_replies(sidecar: str, body: dict[str, Any]) -> list[Reply]:
    response = chat(sidecar, {**body, "stream": False})
    assert response.status_code == 200, response.text[:2000]
    answer = response.json()
    replies = []
    for choice in answer["choices"]:
        message = choice["message"]
        calls = [
            (call["function"]["name"], json.loads(call["function"]["arguments"]))
            for call in message.get("tool_calls") or []
        ]
        replies.append(
            Reply(
                message.get("content"),
                calls,
                choice["finish_reason"],
                choice["token_ids"],
                answer["prompt_token_ids"],
            )
        )
    return replies


def streamed_replies(sidecar: str, body: dict[str, Any]) -> list[Reply]:
    """The stream's chunks put together per choice (asking for token ids, which each delta carries)."""
    response = chat(sidecar, {**body, "stream": True, "return_token_ids": True})
    assert response.status_code == 200, response.text[:2000]
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    replies: dict[int, Reply] = {}
    prompt_token_ids: list[int] = []
    for line in lines[:-1]:
        chunk = json.loads(line)
        prompt_token_ids = chunk.get("prompt_token_ids") or prompt_token_ids
        for choice in chunk["choices"]:
            reply = replies.setdefault(choice["index"], Reply(None, [], None, [], []))
            delta = choice["delta"]
            reply.token_ids += delta.get("token_ids") or []
            if delta.get("content"):
                reply.pieces.append(delta["content"])
            for call in delta.get("tool_calls") or []:
                reply.calls.append((call["function"]["name"], json.loads(call["function"]["arguments"])))
            reply.finish_reason = choice.get("finish_reason") or reply.finish_reason
    for reply in replies.values():
        reply.content = "".join(reply.pieces) if reply.pieces or not reply.calls else None
        reply.prompt_token_ids = prompt_token_ids
    return [replies[index] for index in sorted(replies)]


def plain_reply(sidecar: str, body: dict[str, Any]) -> Reply:
    (reply,) = plain_replies(sidecar, body)
    return reply


def both_replies(sidecar: str, body: dict[str, Any]) -> tuple[Reply, Reply]:
    (streamed,) = streamed_replies(sidecar, body)
    return plain_reply(sidecar, body), streamed
