"""Shared by the hardening tests (a uniquely named module: every test directory has its own conftest)."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import httpx
from service.svc import CALL_TIMEOUT, Server

SIDECAR_KEY = "campaign-sidecar-key"
MAX_SAMPLE_N = 8
MAX_SAMPLE_TOKENS = 64
MAX_TRAIN_TRAJECTORIES = 16
MAX_TRAIN_TOKENS = 3000


@dataclass(frozen=True)
class HostedServer:
    server: Server
    sidecar_url: str


# ---- the campaigns' HTTP rows (test_bad_input_campaign, test_campaign_replies, test_campaign_sessions)

CHAT = "/v1/chat/completions"
COMPLETIONS = "/v1/completions"
GENERATE = "/inference/v1/generate"
HI = [{"role": "user", "content": "hi"}]
BIG_TOKEN = 10**6  # past every test model's vocabulary


@dataclass(frozen=True)
class HttpRow:
    """A request to the hosted sidecar and its expected status and a substring of its error."""

    label: str
    path: str
    body: dict[str, Any] | bytes | None
    status: int
    needle: str
    key: str | None = SIDECAR_KEY
    method: str = "POST"


def http_outcome(sidecar_url: str, row: HttpRow) -> tuple[int, str]:
    """The status `row` gets and its error as "message [param name]"."""
    headers = {"content-type": "application/json"}
    if row.key is not None:
        headers["authorization"] = f"Bearer {row.key}"
    content = row.body if isinstance(row.body, bytes) else json.dumps(row.body).encode() if row.body else None
    response = httpx.request(
        row.method, sidecar_url + row.path, content=content, headers=headers, timeout=CALL_TIMEOUT
    )
    error = response.json().get("error") or {}
    return response.status_code, f"{error.get('message', '')} [param {error.get('param')}]"
