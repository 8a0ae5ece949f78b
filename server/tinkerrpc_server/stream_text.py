"""What a stream of text may send before its end, written once for the service's SampleStream deltas
and the sidecar's streamed content: a tail that could still change is held back."""

from __future__ import annotations

from collections.abc import Sequence


def held_back_from(text: str, stops: Sequence[str]) -> int:
    """Where the part of `text` that may still change starts: an unfinished character at its end (U+FFFD
    until its bytes complete), or a tail that could be the start of a stop string."""
    end = len(text)
    while end > 0 and text[end - 1] == "\ufffd":
        end -= 1
    for stop in stops:
        for length in range(min(len(stop) - 1, len(text)), 0, -1):
            if text.endswith(stop[:length]):
                end = min(end, len(text) - length)
                break
    return end
