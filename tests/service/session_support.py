"""Ending serve's Tinker session from outside, as the backend or a holder of its key would, and calling
serve until it answers again: shared by test_session_recovery.py and the hardening campaign. serve runs
over a separately started `tinkerrpc engine` (LocalEngine), used as Tinker itself, so the test holds the
key that finishes sessions."""

from __future__ import annotations

import re
import time
import urllib.request
from collections.abc import Callable
from typing import TypeVar

import grpc

from tinkerrpc_server.local.stack import LocalEngine

# The engine's shortest session timeout (the CLI takes more than the SDK's 10 s heartbeat).
SESSION_TIMEOUT = 11.0
# How long serve may take to notice a finished session and open a new one: it checks every 5 s, and at
# once when a call fails on the backend.
RECOVERY_SECONDS = 30.0

Answer = TypeVar("Answer")


def sessions(engine: LocalEngine) -> list[str]:
    """The sessions the engine opened, in order (its log names each)."""
    return re.findall(r"session (s[0-9a-f]+) created", engine.log())


def finish_session(engine: LocalEngine, session: str) -> None:
    """What anyone holding the engine's key can do: the Tinker API's finish-session route."""
    request = urllib.request.Request(
        f"{engine.base_url}/api/v1/sessions/{session}/finish", data=b"", headers=engine.auth_headers
    )
    with urllib.request.urlopen(request, timeout=30) as response:
        assert response.status == 200


def until_served(call: Callable[[], Answer], what: str) -> tuple[Answer, int]:
    """`call`'s answer once it succeeds (within RECOVERY_SECONDS), and how many times it failed before;
    every failure must be UNAVAILABLE with a word to retry: a lost session is the server's condition,
    never the caller's error."""
    failures = 0
    deadline = time.monotonic() + RECOVERY_SECONDS
    while True:
        try:
            return call(), failures
        except grpc.RpcError as err:
            assert err.code() == grpc.StatusCode.UNAVAILABLE, f"{what}: {err.code()}: {err.details()}"
            assert "retry" in (err.details() or ""), err.details()
            failures += 1
        assert time.monotonic() < deadline, (
            f"{what} still failing after {RECOVERY_SECONDS} s ({failures} tries)"
        )
        time.sleep(0.2)
