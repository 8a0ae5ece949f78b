"""The short-lived tokens an engine with an API key issues for it (POST /api/v1/auth/token), as the tinker
SDK's JWT exchange expects: the SDK trades its key for one, sends it as its `X-API-Key` from then on,
renews it at half its life, and reads `whoami` from its claims.

Tokens are JWTs signed with HMAC-SHA256 (HS256) under a secret drawn when the engine starts, so they die
with the engine process (the SDK then trades its key again: a rejected token's 401 says
`error="invalid_token"`). Only the API key itself gets a token (routes/auth_token.py); a token whose
signature, algorithm or lifetime is wrong is refused.

Light imports only (engine.auth imports this).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import json
import secrets
import time
from collections import OrderedDict

# Seconds a token lives: the SDK renews it after about half of that, and on demand a minute before it ends.
TOKEN_TTL_SECONDS = 900
# The engine's one principal (whoever holds its key) and its organization, as whoami reports them.
LOCAL_USER_URN = "tml:user:local"
LOCAL_ORG_ID = "local"
ISSUER = "tinkerrpc-engine"
# Tokens longer than this are no token of ours (ours are about 300 bytes).
_MAX_TOKEN_BYTES = 2048
_VERIFIED_REMEMBERED = 64
_HEADER = {"alg": "HS256", "typ": "JWT"}


def _b64(data: bytes) -> bytes:
    return base64.urlsafe_b64encode(data).rstrip(b"=")


def _unb64(data: bytes) -> bytes:
    return base64.urlsafe_b64decode(data + b"=" * (-len(data) % 4))


class TokenIssuer:
    """Issues and checks this engine's tokens (checked on the event loop: its cache has no lock)."""

    def __init__(self) -> None:
        self._secret = secrets.token_bytes(32)
        # Recently verified tokens -> their expiry, so a client's every request does not re-verify.
        self._verified: OrderedDict[bytes, float] = OrderedDict()

    def issue(self, now: float | None = None) -> str:
        issued = int(time.time() if now is None else now)
        claims = {
            "iss": ISSUER,
            "sub": LOCAL_USER_URN,
            "org_id": LOCAL_ORG_ID,
            "email": "",
            "iat": issued,
            "exp": issued + TOKEN_TTL_SECONDS,
            "jti": secrets.token_hex(8),
        }
        signed = _b64(json.dumps(_HEADER).encode()) + b"." + _b64(json.dumps(claims).encode())
        return (signed + b"." + _b64(self._sign(signed))).decode()

    def _sign(self, signed: bytes) -> bytes:
        return hmac.new(self._secret, signed, hashlib.sha256).digest()

    def is_valid(self, token: bytes, now: float | None = None) -> bool:
        """Whether `token` is one this engine issued and it has not expired."""
        now = time.time() if now is None else now
        expires = self._verified.get(token)
        if expires is not None:
            return now < expires
        expires = self._expiry(token)
        if expires is None or now >= expires:
            return False
        self._verified[token] = expires
        while len(self._verified) > _VERIFIED_REMEMBERED:
            self._verified.popitem(last=False)
        return True

    def _expiry(self, token: bytes) -> float | None:
        """The expiry of a well-formed token signed here, else None."""
        if len(token) > _MAX_TOKEN_BYTES or token.count(b".") != 2:
            return None
        header, claims, signature = token.split(b".")
        try:
            valid = hmac.compare_digest(_unb64(signature), self._sign(header + b"." + claims))
            if not valid or json.loads(_unb64(header)) != _HEADER:
                return None
            expires = json.loads(_unb64(claims)).get("exp")
        except (ValueError, binascii.Error, AttributeError):
            return None
        return float(expires) if isinstance(expires, int) else None
