"""The one parser of JSON carried in request strings (a tool's parameters_json, a tool call's
arguments_json), bounded so that no text a client sends can make it fail any other way than with a
reason: Python's own json.loads raises ValueError past 4300 integer digits, RecursionError on deep
nesting, and accepts NaN and Infinity, which are not JSON and no template can render back. Its size is
bounded before it gets here, with the rest of the request's text (validation.MAX_TEXT_BYTES_PER_TOKEN)."""

from __future__ import annotations

import json
import math
from typing import Any

# Longer than any JSON Schema bound or argument a tool takes (an int64 is 20 characters, a double's
# shortest exact form 24); far under the 4300 digits where Python refuses to convert an integer.
MAX_NUMBER_CHARS = 100
# Arrays and objects inside one another, the outermost counted as 1: real schemas nest a handful of
# levels, and every layer that walks the value afterwards (renderers, dataclasses.asdict) recurses.
MAX_DEPTH = 64


class ToolJsonError(ValueError):
    """Why a text is not a JSON object this server takes; the message completes "must be a JSON object (...)"."""


def _refuse_constant(name: str) -> float:
    raise ToolJsonError(f"{name} is not a JSON number")


def _checked_length(literal: str) -> None:
    if len(literal) > MAX_NUMBER_CHARS:
        raise ToolJsonError(f"a number of {len(literal)} characters: at most {MAX_NUMBER_CHARS}")


def _parse_int(literal: str) -> int:
    _checked_length(literal)
    return int(literal)


def _parse_float(literal: str) -> float:
    _checked_length(literal)
    value = float(literal)
    if not math.isfinite(value):
        raise ToolJsonError(f"{literal} is out of the range of a double")
    return value


def _too_deep(value: object) -> bool:
    """Whether a parsed value nests past MAX_DEPTH, walked without recursion."""
    pending: list[tuple[object, int]] = [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        if depth > MAX_DEPTH:
            return True
        pending.extend((child, depth + 1) for child in children)
    return False


_TOO_DEEP = f"nested too deeply: more than {MAX_DEPTH} levels"
_KINDS = {list: "an array", str: "a string", bool: "a boolean", int: "a number", float: "a number"}


def parse_json_object(text: str) -> dict[str, Any]:
    """`text` (empty means {}) as a JSON object; ToolJsonError saying why it is not one."""
    try:
        value = json.loads(
            text or "{}", parse_int=_parse_int, parse_float=_parse_float, parse_constant=_refuse_constant
        )
    except json.JSONDecodeError as error:
        raise ToolJsonError(f"invalid JSON at character {error.pos}") from None
    except RecursionError:
        raise ToolJsonError(_TOO_DEEP) from None
    if _too_deep(value):
        raise ToolJsonError(_TOO_DEEP)
    if not isinstance(value, dict):
        raise ToolJsonError(f"got {_KINDS.get(type(value), 'null')}")
    return value
