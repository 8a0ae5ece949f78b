"""The engine's one access check: every HTTP request but the health check carries the API key the engine
was started with, or a token the engine issued for it (engine.tokens), as the tinker SDK sends either
(`X-API-Key`, its only credential header).

Downloads of external weights and of session traces are the exception: their URLs are signed and
expire (signed_urls), so whoever was handed a URL downloads without the key, as with Tinker's own URLs.

Light imports only: `serve` generates the key of its engine child before it imports the heavy modules.
"""

from __future__ import annotations

import hmac
import ipaddress
import json
import re
import secrets
from typing import TYPE_CHECKING

from tinkerrpc_server.engine.tokens import TokenIssuer

if TYPE_CHECKING:
    from starlette.types import ASGIApp, Receive, Scope, Send

HEALTH_PATH = "/api/v1/healthz"
SIGNED_DOWNLOADS_PREFIX = "/api/v1/external_weights_files/"
SIGNED_TRACES_PREFIX = "/api/v1/session_traces/"
API_KEY_HEADER = b"x-api-key"
# The tinker SDK refuses keys that do not start with `tml-`; the rest must be long enough not to guess.
_API_KEY_PATTERN = re.compile(r"tml-[A-Za-z0-9._~+/=-]{16,256}")

_UNAUTHORIZED_BODY = json.dumps(
    {
        "detail": "missing or wrong X-API-Key: this engine serves only clients holding the key it was "
        "started with (tinker SDK: api_key=... or $TINKER_API_KEY)"
    }
).encode()
_INVALID_TOKEN_BODY = json.dumps(
    {"detail": "X-API-Key holds a token this engine did not issue, or one that has expired"}
).encode()
# RFC 6750: the SDK trades its key for a new token when a 401 says this, and replays the request once.
_INVALID_TOKEN_CHALLENGE = b'Bearer error="invalid_token"'


def generate_api_key() -> str:
    """A fresh random key of the shape the tinker SDK accepts."""
    return f"tml-{secrets.token_urlsafe(32)}"


def api_key_problem(key: str) -> str | None:
    """Why `key` cannot be an engine key, or None when it can."""
    if _API_KEY_PATTERN.fullmatch(key) is None:
        return (
            "the API key must be 'tml-' followed by 16 to 256 letters, digits or '._~+/=-' "
            "(the tinker SDK sends no other shape)"
        )
    return None


def is_loopback_host(host: str) -> bool:
    """Whether listening on `host` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ApiKeyMiddleware:
    """Answers 401 to any HTTP request without the right `X-API-Key` (the key, or a live token of
    `tokens`), before routing (an unknown path reveals nothing either); the health check and signed
    downloads pass. Keys and signatures are compared in constant time."""

    def __init__(self, app: ASGIApp, api_key: str, tokens: TokenIssuer) -> None:
        self._app = app
        self._expected = api_key.encode()
        self._tokens = tokens

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or self._is_open(scope["path"]):
            await self._app(scope, receive, send)
            return
        presented = next((value for name, value in scope["headers"] if name == API_KEY_HEADER), b"")
        is_token = presented.startswith(b"eyJ")  # a JWT: the SDK's key never starts so ("tml-")
        if self._tokens.is_valid(presented) if is_token else hmac.compare_digest(presented, self._expected):
            await self._app(scope, receive, send)
            return
        body = _INVALID_TOKEN_BODY if is_token else _UNAUTHORIZED_BODY
        headers = [
            (b"content-type", b"application/json"),
            (b"content-length", str(len(body)).encode()),
            # The SDK does not retry a 401 anyway; say so for any other client.
            (b"x-should-retry", b"false"),
        ]
        if is_token:
            headers.append((b"www-authenticate", _INVALID_TOKEN_CHALLENGE))
        await send({"type": "http.response.start", "status": 401, "headers": headers})
        await send({"type": "http.response.body", "body": body})

    @staticmethod
    def _is_open(path: str) -> bool:
        return path == HEALTH_PATH or path.startswith((SIGNED_DOWNLOADS_PREFIX, SIGNED_TRACES_PREFIX))
