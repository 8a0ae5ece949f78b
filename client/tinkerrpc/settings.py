"""What the SDK takes from its process environment: the one module of the SDK that reads it.

The SDK may not import the server, so it has a reader of its own; the server's `settings` takes the
variable's name from here, so both sides agree on it.
"""

from __future__ import annotations

import os

SIDECAR_API_KEY_ENV = "TINKERRPC_SIDECAR_API_KEY"


def sidecar_api_key_from_environment() -> str:
    """$TINKERRPC_SIDECAR_API_KEY, or "" when unset."""
    return os.environ.get(SIDECAR_API_KEY_ENV, "")
