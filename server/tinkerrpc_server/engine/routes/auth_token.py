"""The tinker SDK's JWT exchange (POST /api/v1/auth/token): the engine's API key for a short-lived token
(engine.tokens). The SDK asks for it when the client config says `pjwt_auth_enabled`, which an engine
with a key does; `RestClient.whoami` reads the principal from the token's claims.

Only the key itself is exchanged: a token cannot renew itself, so a stolen one ends with its lifetime.
An engine without a key (insecure_no_auth) has no principal to vouch for and issues no tokens (404).
"""

from __future__ import annotations

import hmac

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from tinker import types

from tinkerrpc_server.engine.auth import API_KEY_HEADER
from tinkerrpc_server.engine.core import NotFound
from tinkerrpc_server.engine.routes.common import EngineDep
from tinkerrpc_server.engine.tokens import TokenIssuer

router = APIRouter(prefix="/api/v1")


@router.post("/auth/token", response_model=None)
async def auth_token(request: Request, engine: EngineDep) -> types.AuthTokenResponse | JSONResponse:
    api_key = engine.config.api_key
    if api_key is None:
        raise NotFound("this engine serves without an API key and issues no tokens")
    presented = request.headers.get(API_KEY_HEADER.decode(), "").encode()
    if not hmac.compare_digest(presented, api_key.encode()):
        return JSONResponse(
            {"detail": "X-API-Key: only the engine's API key is exchanged for a token, not a token"},
            status_code=401,
            headers={"x-should-retry": "false"},
        )
    tokens: TokenIssuer = request.app.state.tokens
    return types.AuthTokenResponse(jwt=tokens.issue())
