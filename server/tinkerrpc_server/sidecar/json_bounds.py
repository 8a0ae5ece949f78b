"""The JSON bounds (`tinkerrpc_server.bounded_json`, the one bounded parser) at the sidecar's door:
request bodies are checked before FastAPI parses them, and the JSON texts inside a request (tool-call
arguments) where the request's model meets them; a broken bound is a 400 naming where it is.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from tinkerrpc_server.bounded_json import BoundedJsonError, loads_bounded
from tinkerrpc_server.sidecar.errors import OpenAIError, bad_request
from tinkerrpc_server.sidecar.extensions import noting_ignored_fields


def _refused(error: BoundedJsonError) -> OpenAIError:
    return bad_request(f"{error.path or 'the request body'}: {error.reason}", error.path or None)


def check_json_text(text: str, path: str) -> None:
    """A JSON text inside a request (tool-call arguments): within bounds if it is JSON; text that is
    not JSON passes, as a model may have sampled it."""
    with contextlib.suppress(json.JSONDecodeError):
        try:
            loads_bounded(text, path)
        except BoundedJsonError as error:
            raise _refused(error) from None


class BoundedJSONRoute(APIRoute):
    """A route whose JSON body is checked against the bounds before FastAPI parses it into the
    request model (the body is read once; FastAPI reuses it); the fields its parsing ignored (vendor
    extensions, `extensions`) are named on the response."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            body = await request.body()
            # FastAPI answers a body that is not JSON itself.
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                try:
                    loads_bounded(body)
                except BoundedJsonError as error:
                    raise _refused(error) from None
            return await noting_ignored_fields(handler, request)

        return bounded
