"""Who runs next on the compute thread: the one place the engine's fair share is decided.

The participants are each base model's running sample batch (its lane) and training, all of it, as one
more participant. A turn is a stretch of decoding that ends as soon as someone else is ready, or one
training operation; its passes are what cannot be cut short (a decode step or prefill chunk, a training
operation), and a batch decoding alone runs many in one turn. Compute time is shared, not turns: of those
ready, the one whose time used plus the length of its last pass is least runs next (fair queuing by
finish time), so a small model whose steps take 2 ms runs about as many of them as fit in one step of a
large model before that model's next step, and a small request does not wait one large step per token of
its own. A participant that becomes ready starts one pass ahead of the least served of the others (the
longest last pass among them), as a scheduler credits a task that wakes: it runs at the next turn, for
up to two of the others' passes before they run again, so a short request (a small model's sample, one
training op) is answered about one pass of each other active participant later than alone, instead of
sharing the compute from its first step. Idle time earns no more credit than that, so the others lose at
most a pass or two each time someone becomes ready. Ties go to whoever waited longest.
"""

from __future__ import annotations

import itertools
from collections.abc import Collection, Hashable
from dataclasses import dataclass


@dataclass
class _Account:
    used: float  # seconds of compute since it became ready (from the level it started at)
    last_pass_seconds: float = 0.0
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
        accounts = self._accounts.values()
        credit = max((account.last_pass_seconds for account in accounts), default=0.0)
        level = min((account.used for account in accounts), default=0.0) - credit
        for key in ready:
            self._accounts.setdefault(key, _Account(level))

        def finish(key: Hashable) -> tuple[float, int]:
            account = self._accounts[key]
            return account.used + account.last_pass_seconds, account.last_turn

        return min(ready, key=finish)

    def charge(self, key: Hashable, seconds: float, passes: int = 1) -> None:
        """`key` just ran for `seconds`, in `passes` passes."""
        account = self._accounts.get(key)
        if account is not None:
            account.used += seconds
            account.last_pass_seconds = seconds / max(1, passes)
            account.last_turn = next(self._turns)
