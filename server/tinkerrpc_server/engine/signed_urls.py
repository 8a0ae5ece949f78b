"""Signed download URLs for the files of external-weights checkpoints.

The signature is an HMAC with a secret drawn at engine start, so URLs die with the engine process.
"""

from __future__ import annotations

import hashlib
import hmac
import json

# How long the signed URLs of get_external_weights_urls stay valid.
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
    if not (expires.isascii() and expires.isdigit()) or not hmac.compare_digest(
        sign_file(secret, model_id, name, file, int(expires)).encode(), signature.encode()
    ):
        raise Forbidden("invalid signature")
    if int(expires) < now:
        raise Forbidden("this URL has expired; ask get_external_weights_urls for new ones")
