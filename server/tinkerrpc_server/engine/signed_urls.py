"""Signed download URLs for the files of external-weights checkpoints and for session traces.

The signature is an HMAC with a secret drawn at engine start, so URLs die with the engine process.
"""

from __future__ import annotations

import hashlib
import hmac
import json
from collections.abc import Callable

# How long the signed URLs of get_external_weights_urls and export_session_trace stay valid.
EXTERNAL_URL_TTL_SECONDS = 3600


class Forbidden(PermissionError):
    """A signed URL whose signature is wrong or expired: HTTP 403."""


def sign_file(secret: bytes, model_id: str, name: str, file: str, expires: int) -> str:
    """HMAC-SHA256 (hex) of one external-weights file and the unix time its URL expires."""
    message = json.dumps([model_id, name, file, expires]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def check_file_signature(
    secret: bytes, model_id: str, name: str, file: str, expires: str, signature: str, now: float
) -> None:
    """Forbidden unless `signature` signs exactly this file and `expires`, and `expires` is still ahead."""
    _check(lambda at: sign_file(secret, model_id, name, file, at), expires, signature, now)


def sign_trace(secret: bytes, session_id: str, expires: int) -> str:
    """HMAC-SHA256 (hex) of a session's trace download and the unix time its URL expires (a message of
    another shape than a file's, so no file URL's signature signs a trace)."""
    message = json.dumps({"session_trace": session_id, "expires": expires}).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def check_trace_signature(secret: bytes, session_id: str, expires: str, signature: str, now: float) -> None:
    _check(lambda at: sign_trace(secret, session_id, at), expires, signature, now)


def _check(sign: Callable[[int], str], expires: str, signature: str, now: float) -> None:
    if not (expires.isascii() and expires.isdigit() and len(expires) <= 20) or not hmac.compare_digest(
        sign(int(expires)).encode(), signature.encode()
    ):
        raise Forbidden("invalid signature")
    if int(expires) < now:
        raise Forbidden("this URL has expired; ask for a new one")
