"""A training client's recent numbered requests, so a resent one is answered by its first.

The SDK resends a request whose answer it did not get (a timeout, a 5xx) with the same body, and never
reuses a seq_id otherwise: such a repeat is the same request and must not run twice.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict

log = logging.getLogger("tinkerrpc.engine")

# Sequenced requests remembered per training client, so a resent one is recognised.
SEQUENCED_REMEMBERED = 256


class SequencedRequests:
    """Thread-safe: routes record requests, the compute thread forgets an unloaded client's."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        # model_id -> seq_id -> (operation, request id) of its recent sequenced requests.
        self._recent: dict[str, OrderedDict[int, tuple[str, str]]] = {}

    def remember(self, model_id: str, seq_id: int, name: str, request_id: str) -> None:
        with self._lock:
            recent = self._recent.setdefault(model_id, OrderedDict())
            recent[seq_id] = (name, request_id)
            while len(recent) > SEQUENCED_REMEMBERED:
                recent.popitem(last=False)

    def earlier(self, model_id: str, seq_id: int | None, name: str) -> str | None:
        """The request id of a recent `name` operation of `model_id` with this seq_id, if any."""
        if seq_id is None:
            return None
        with self._lock:
            recent = self._recent.get(model_id)
            found = recent.get(seq_id) if recent is not None else None
        if found is None or found[0] != name:
            return None
        log.info("%s %s seq=%d sent again: answered by its first request", name, model_id, seq_id)
        return found[1]

    def forget(self, model_id: str) -> None:
        with self._lock:
            self._recent.pop(model_id, None)
