"""The yes / no / maybe task (ART's yes-no-maybe example): a prompt asks for exactly one of three
words; "maybe" scores 1.0, "no" 0.75, "yes" 0.5 and anything else 0.

Standard library only, so that whatever uses the task reads it from here: the demo's recipe, the
built-in tiny model's tokenizer corpus (model_store), ART's flow in tests/art and the examples (which
run with the client install alone)."""

from __future__ import annotations

import itertools

ANSWERS = ("yes", "no", "maybe")
REWARDS = {"maybe": 1.0, "no": 0.75, "yes": 0.5}


def prompts() -> list[str]:
    """The task's 48 prompts: every ordering of 2 or 3 of the answers, bare or quoted, after "respond
    with" or "just respond with"."""
    found = []
    for prefix in ("respond", "just respond"):
        for use_quotes in (False, True):
            for n in (3, 2):
                for words in itertools.permutations(ANSWERS, n):
                    quoted = [f"'{w}'" if use_quotes else w for w in words]
                    listed = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if n == 3 else " or ".join(quoted)
                    found.append(f"{prefix} with {listed}")
    return found


def answer_of(reply: str) -> str:
    """A reply as the answer it gives: case and surrounding whitespace do not count."""
    return reply.strip().lower()


def reward_of(reply: str) -> float:
    return REWARDS.get(answer_of(reply), 0.0)
