"""The one parser of JSON a request carries, for the service and the sidecar alike: the sidecar's
request bodies and the JSON texts inside requests (a tool's parameters, a tool call's arguments).

Python's own `json.loads` takes what later stages cannot: NaN and Infinity literals (not JSON, and no
template renders them back), numbers too long to convert (`int()` refuses past 4300 digits) or beyond a
double, containers of any size, and nesting deep enough to exhaust recursion when the value is parsed,
copied or rendered. Each is refused here with a `BoundedJsonError` naming the reason and where it is;
the bounds are the contract's (`tinkerrpc.contract.limits`). A neutral module: the service and the
sidecar both import it, neither imports the other.
"""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tinkerrpc.contract.limits import MAX_JSON_DEPTH, MAX_JSON_ENTRIES, MAX_JSON_NUMBER_CHARS


class BoundedJsonError(ValueError):
    """Why a JSON text is refused: `reason` (also the message) and `path`, where in the value it is
    (dotted keys and [i] indexes after the caller's prefix; "" for the text as a whole)."""

    def __init__(self, reason: str, path: str = "") -> None:
        super().__init__(reason)
        self.reason = reason
        self.path = path


class _Refused:
    """Stands in for a literal the parser refused, so the walk after parsing can name where it was."""

    def __init__(self, reason: str) -> None:
        self.reason = reason


def _too_long(literal: str) -> _Refused | None:
    if len(literal) > MAX_JSON_NUMBER_CHARS:
        return _Refused(f"a number of {len(literal)} characters: at most {MAX_JSON_NUMBER_CHARS}")
    return None


def _parse_int(literal: str) -> int | _Refused:
    return _too_long(literal) or int(literal)


def _parse_float(literal: str) -> float | _Refused:
    refused = _too_long(literal)
    if refused is not None:
        return refused
    value = float(literal)
    return value if math.isfinite(value) else _Refused(f"{literal} is out of the range of a double")


def _parse_constant(literal: str) -> _Refused:
    return _Refused(f"{literal} is not a JSON number")


def _child(path: str, key: str | int) -> str:
    if isinstance(key, int):
        return f"{path}[{key}]"
    return f"{path}.{key}" if path else key


_TOO_DEEP = f"nested too deeply: more than {MAX_JSON_DEPTH} levels"


def _check_value(value: Any, path: str) -> None:
    """BoundedJsonError for the first place in `value`, in document order, that breaks a bound; walked
    without recursion. The outermost container is level 1."""
    pending: list[tuple[Any, str, int]] = [(value, path, 1)]
    while pending:
        node, where, depth = pending.pop()
        if isinstance(node, _Refused):
            raise BoundedJsonError(node.reason, where)
        if not isinstance(node, dict | list):
            continue
        if depth > MAX_JSON_DEPTH:
            raise BoundedJsonError(_TOO_DEEP, where)
        if len(node) > MAX_JSON_ENTRIES:
            raise BoundedJsonError(f"{len(node)} entries: at most {MAX_JSON_ENTRIES}", where)
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


def loads_bounded(text: str | bytes, path: str = "") -> Any:
    """`text` parsed and checked against the bounds, `path` prefixing the places errors name. A text
    that is not JSON at all raises `json.JSONDecodeError` (or, for bytes, `UnicodeDecodeError`) for the
    caller to judge; a bound broken raises BoundedJsonError."""
    try:
        value = json.loads(
            text, parse_int=_parse_int, parse_float=_parse_float, parse_constant=_parse_constant
        )
    except RecursionError:
        where = _too_deep_path(text.decode() if isinstance(text, bytes) else text, path)
        raise BoundedJsonError(_TOO_DEEP, where) from None
    _check_value(value, path)
    return value


_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


def parse_json_object(text: str) -> dict[str, Any]:
    """`text` (empty means {}) as a JSON object within the bounds; BoundedJsonError saying why it is
    not one ("invalid JSON at character N", "got an array", or the bound it breaks)."""
    try:
        value = loads_bounded(text or "{}")
    except json.JSONDecodeError as error:
        raise BoundedJsonError(f"invalid JSON at character {error.pos}") from None
    if not isinstance(value, dict):
        raise BoundedJsonError(f"got {_KINDS.get(type(value), 'null')}")
    return value
