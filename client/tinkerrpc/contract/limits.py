"""Every fixed bound and default of the tinkerrpc contract (filled in by layer as they switch over)."""

from __future__ import annotations

# --- JSON carried in requests (the sidecar's bodies, a tool's parameters_json, a call's arguments_json)
# Arrays and objects inside one another: real schemas nest a handful of levels, and every layer that
# walks the value afterwards (renderers, dataclasses.asdict) recurses; far from Python's recursion limit.
MAX_JSON_DEPTH = 64
# Entries of one object or array: a legacy prompt of token ids is the longest list a request needs.
MAX_JSON_ENTRIES = 1 << 17
# Characters of one number literal: an int64 is 20, a double's shortest exact form 24; far under the
# 4300 digits where Python refuses to convert an integer.
MAX_JSON_NUMBER_CHARS = 100
