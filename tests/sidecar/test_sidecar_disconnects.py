"""A client that leaves is no server error (issue 40 item 7): a request whose body stops short or
whose answer nobody waits for is logged at INFO at most, with no traceback, so an operator can trust
ERROR in the sidecar's log."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest
from sidecar_support import API_KEY, Sidecar

pytestmark = pytest.mark.process

BODY = json.dumps({"model": "m", "messages": [{"role": "user", "content": "hi"}]}).encode()


def _request_head(length: int) -> bytes:
    return (
        "POST /v1/chat/completions HTTP/1.1\r\nHost: sidecar\r\n"
        f"Authorization: Bearer {API_KEY}\r\nContent-Type: application/json\r\nContent-Length: {length}\r\n\r\n"
    ).encode()


def _connect(sidecar: Sidecar) -> socket.socket:
    host, port = sidecar.base_url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=10)


def _settled_log(sidecar: Sidecar, needle: str) -> str:
    """The log once `needle` is in it (the sidecar logs after the client has gone)."""
    deadline = time.monotonic() + 10
    while needle not in sidecar.log() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.5)  # anything logged after it, such as uvicorn's own report, has landed too
    return sidecar.log()


def test_a_body_cut_short_by_a_client_that_leaves_is_no_error(orphan_sidecar: Sidecar) -> None:
    with _connect(orphan_sidecar) as connection:
        connection.sendall(_request_head(len(BODY)) + BODY[:10])
        time.sleep(0.3)
    log = _settled_log(orphan_sidecar, "client disconnected")
    assert (
        "INFO tinkerrpc.sidecar: client disconnected before the request was read: POST /v1/chat/completions"
        in log
    )
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]


def test_a_client_that_leaves_before_its_answer_is_no_error(orphan_sidecar: Sidecar) -> None:
    for _ in range(3):
        with _connect(orphan_sidecar) as connection:
            connection.sendall(_request_head(len(BODY)) + BODY)
    # The sidecar still answers the next client, and its log holds no error for those that left.
    answered = httpx.post(
        f"{orphan_sidecar.base_url}/v1/chat/completions",
        content=BODY,
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
        timeout=30,
    )
    assert answered.status_code == 503
    log = orphan_sidecar.log()
    assert "ERROR" not in log and "Traceback" not in log, log[-3000:]
