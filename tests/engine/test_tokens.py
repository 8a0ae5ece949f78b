"""The engine's tokens for the SDK's JWT exchange (engine/tokens.py): what the SDK reads from them, and
that only an unexpired token signed by the same engine passes."""

from __future__ import annotations

import base64
import json

import pytest
from tinker.lib._jwt_auth import jwt_claims
from tinker.lib.public_interfaces.rest_client import _whoami_response_from_jwt

from tinkerrpc_server.engine.tokens import TOKEN_TTL_SECONDS, TokenIssuer

pytestmark = pytest.mark.unit

NOW = 1_800_000_000.0


def _part(payload: dict[str, object]) -> str:
    return base64.urlsafe_b64encode(json.dumps(payload).encode()).rstrip(b"=").decode()


def test_the_sdk_reads_its_identity_and_lifetime_from_a_token() -> None:
    token = TokenIssuer().issue(now=NOW)
    claims = jwt_claims(token)
    assert (claims["iat"], claims["exp"]) == (NOW, NOW + TOKEN_TTL_SECONDS)
    who = _whoami_response_from_jwt(token)
    assert (who.user_urn, who.org_urn, who.email) == ("tml:user:local", "tml:organization:local", None)
    assert token.startswith("eyJ")  # how the SDK and the engine's check tell a token from a key


def test_only_a_live_token_of_the_same_engine_passes() -> None:
    issuer = TokenIssuer()
    token = issuer.issue(now=NOW)
    assert issuer.is_valid(token.encode(), now=NOW + 1)
    assert not issuer.is_valid(token.encode(), now=NOW + TOKEN_TTL_SECONDS)  # expired, even when cached
    assert not TokenIssuer().is_valid(token.encode(), now=NOW + 1)  # another engine's (or a restarted one's)

    header, claims, signature = token.split(".")
    longer = _part({**jwt_claims(token), "exp": NOW + 10 * TOKEN_TTL_SECONDS})
    unsigned = _part({"alg": "none", "typ": "JWT"})
    for forged in (
        f"{header}.{longer}.{signature}",  # a claim changed under the old signature
        f"{unsigned}.{claims}.",  # alg none
        f"{unsigned}.{claims}.{signature}",
        f"{header}.{claims}",
        f"{header}.{claims}.{signature}.x",
        f"{header}.{claims}.!!!",
        "eyJ" + "A" * 5000,
    ):
        assert not issuer.is_valid(forged.encode(), now=NOW + 1), forged
