"""Who runs next on the compute thread: the one place the engine's fair share is decided.

The participants are each base model's running sample batch (its lane) and training, all of it, as one
more participant. A turn is a stretch of decoding that ends as soon as someone else is ready (a decode
step or a prefill chunk), or one training operation. Compute time is shared, not turns: of those ready,
the one whose time used plus the length of its last turn is least runs next (fair queuing by finish
time), so a small model whose steps take 2 ms runs about as many of them as fit in one step of a large
model before that model's next step, and a small request does not wait one large step per token of its
own. A participant that becomes ready starts level with the least served of the others, with no turn
behind it, so it runs at the next turn and idle time earns no credit: a request for one model waits
about one turn of each other active participant before it runs. Ties go to whoever waited longest.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable
from dataclasses import dataclass


@dataclass
class _Account:
    used: float  # seconds of compute since it became ready (from the level it started at)
    last_turn_seconds: float = 0.0
    last_turn: int = -1  # when it last ran (-1: not since it became ready)


class FairShare:
    """Compute time used per ready participant, and the choice of the next turn (compute thread)."""

    def __init__(self) -> None:
        self._accounts: dict[Hashable, _Account] = {}
        self._turns = itertools.count()

    def next_turn(self, ready: Collection[Hashable]) -> Hashable:
        """Of `ready` (not empty), who runs next; participants not in it are forgotten."""
        for gone in [key for key in self._accounts if key not in ready]:
            del self._accounts[gone]
        level = min((account.used for account in self._accounts.values()), default=0.0)
        for key in ready:
            self._accounts.setdefault(key, _Account(level))

        def finish(key: Hashable) -> tuple[float, int]:
            account = self._accounts[key]
            return account.used + account.last_turn_seconds, account.last_turn

        return min(ready, key=finish)

    def charge(self, key: Hashable, seconds: float) -> None:
        """`key` just ran for `seconds`."""
        account = self._accounts.get(key)
        if account is not None:
            account.used += seconds
            account.last_turn_seconds = seconds
            account.last_turn = next(self._turns)
