"""Bounds on the JSON the sidecar accepts: request bodies, and the JSON texts inside them (tool-call
arguments).

Python's `json` takes what later stages cannot: NaN and Infinity literals (not JSON), numbers too long
to convert (over 4300 digits `int()` refuses), and nesting deep enough to exhaust recursion when the
value is copied or encoded. Each is refused here with a 400 naming where it is, before any of it
reaches the SDK or the server.
"""

from __future__ import annotations

import contextlib
import json
import math
import re
from collections.abc import Callable, Coroutine
from typing import Any

from fastapi import Request, Response
from fastapi.routing import APIRoute

from tinkerrpc_server.sidecar.errors import bad_request

# Deep enough for any tool schema or content-part list; far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Entries of one object or array: a legacy prompt of token ids is the longest list a request needs.
MAX_JSON_ENTRIES = 1 << 17
# Characters of one number literal: a float64 or int64 needs at most 25.
MAX_NUMBER_CHARS = 100


class _Refused:
    """Stands in for a literal the parser met, so the walk can name where it was."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _parse_int(literal: str) -> int | _Refused:
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"an integer of {len(literal)} characters (at most {MAX_NUMBER_CHARS})")
    return int(literal)


def _parse_float(literal: str) -> float | _Refused:
    if len(literal) > MAX_NUMBER_CHARS:
        return _Refused(f"a number of {len(literal)} characters (at most {MAX_NUMBER_CHARS})")
    value = float(literal)
    return value if math.isfinite(value) else _Refused(f"{literal}, which overflows a float")


def _parse_constant(literal: str) -> _Refused:
    return _Refused(f"{literal}, which is not a JSON number")


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


def check_json_value(value: Any, path: str) -> None:
    """400 naming the first place in `value` (parsed by `loads_bounded`) that breaks a bound."""
    pending: list[tuple[Any, str, int]] = [(value, path, 0)]
    while pending:
        node, where, depth = pending.pop()
        if isinstance(node, _Refused):
            raise bad_request(f"{where or 'the request body'} holds {node.reason}", where or None)
        if not isinstance(node, dict | list):
            continue
        if depth >= MAX_JSON_DEPTH:
            raise bad_request(
                f"{where or 'the request body'} is nested more than {MAX_JSON_DEPTH} levels deep",
                where or None,
            )
        if len(node) > MAX_JSON_ENTRIES:
            raise bad_request(
                f"{where or 'the request body'} has {len(node)} entries (at most {MAX_JSON_ENTRIES})",
                where or None,
            )
        items = node.items() if isinstance(node, dict) else enumerate(node)
        # Reversed so that the first offending entry in document order is the one named.
        pending.extend((child, _child(where, key), depth + 1) for key, child in reversed(list(items)))


_JSON_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{},:]')


def _too_deep_path(text: str, path: str) -> str:
    """Where `text` first nests deeper than the bound, found by scanning its brackets (for a text too
    deep for the parser's recursion, which cannot say where it gave up)."""
    # One frame per open container: [the key or index being read, whether a key is awaited].
    frames: list[list[Any]] = []
    last_string = ""
    for match in _JSON_TOKEN.finditer(text):
        token = match.group()
        if token in "[{":
            if len(frames) >= MAX_JSON_DEPTH:
                break
            frames.append([0 if token == "[" else "", token == "{"])
        elif token in "]}":
            if frames:
                frames.pop()
        elif token == ",":
            if frames and isinstance(frames[-1][0], int):
                frames[-1][0] += 1
            elif frames:
                frames[-1][1] = True
        elif token == ":":
            if frames and frames[-1][1]:
                frames[-1][0], frames[-1][1] = last_string, False
        else:
            last_string = json.loads(token)
    for key, _ in frames:
        path = _child(path, key)
    return path


def loads_bounded(text: str | bytes, path: str) -> Any:
    """`text` parsed and checked against the bounds; a text that is not JSON at all raises
    `json.JSONDecodeError` (or, for bytes, `UnicodeDecodeError`) for the caller to judge."""
    try:
        value = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except RecursionError:
        where = _too_deep_path(text.decode() if isinstance(text, bytes) else text, path)
        raise bad_request(
            f"{where or 'the request body'} is nested more than {MAX_JSON_DEPTH} levels deep", where or None
        ) from None
    check_json_value(value, path)
    return value


def check_json_text(text: str, path: str) -> None:
    """A JSON text inside a request (tool-call arguments): within bounds if it is JSON; text that is
    not JSON passes, as a model may have sampled it."""
    with contextlib.suppress(json.JSONDecodeError):
        loads_bounded(text, path)


class BoundedJSONRoute(APIRoute):
    """A route whose JSON body is checked against the bounds before FastAPI parses it into the
    request model (the body is read once; FastAPI reuses it)."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handler = super().get_route_handler()

        async def bounded(request: Request) -> Response:
            body = await request.body()
            # FastAPI answers a body that is not JSON itself.
            with contextlib.suppress(json.JSONDecodeError, UnicodeDecodeError):
                loads_bounded(body, "")
            return await handler(request)

        return bounded
