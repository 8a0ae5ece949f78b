"""`openai` clients pointed at a server's hosted sidecar (`Model.openai_client()` and its siblings).

`openai` is the optional `tinkerrpc[openai]` extra: it is imported only when such a client is made.
The openai client has no default model, so requests pass `model=model.name` (or `name@N` to pin a
version), as with any OpenAI-compatible server; the client itself is the library's own, unwrapped, so
every framework that takes an `openai.OpenAI`/`AsyncOpenAI` takes it.
"""

from __future__ import annotations

from types import ModuleType

from tinkerrpc._server_info import ServerInfo
from tinkerrpc.settings import SIDECAR_API_KEY_ENV, sidecar_api_key_from_environment

# The openai client refuses to start without a key; a sidecar without one ignores what it is sent.
KEYLESS_PLACEHOLDER = "tinkerrpc-sidecar-without-key"


def sidecar_connection(
    info: ServerInfo | None, sidecar_url: str | None, api_key: str | None
) -> tuple[str, str]:
    """(base_url, api_key) for an openai client: the explicit URL, else the one the server hosts; the
    explicit key, else $TINKERRPC_SIDECAR_API_KEY, else (for a sidecar that needs none) a placeholder."""
    url = sidecar_url or (info.sidecar_url if info is not None else None)
    if not url:
        raise ValueError(
            "the server hosts no OpenAI sidecar: start it with `tinkerrpc serve --sidecar-port PORT`, "
            "or pass sidecar_url= for a standalone `tinkerrpc sidecar`"
        )
    key = api_key or sidecar_api_key_from_environment()
    if not key:
        if info is not None and info.sidecar_requires_api_key:
            raise ValueError(
                f"the sidecar at {url} requires an API key: pass api_key= or set ${SIDECAR_API_KEY_ENV}"
            )
        key = KEYLESS_PLACEHOLDER
    return url, key


def import_openai() -> ModuleType:
    try:
        import openai
    except ImportError as err:
        raise ImportError(
            "an OpenAI client needs the openai package: pip install 'tinkerrpc[openai]'"
        ) from err
    return openai
