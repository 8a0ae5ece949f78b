"""Addition problems with an exact checker, split from a seed into a training set and a held-out set.

The prompt states the answer format (a bare number); a reply is correct only when it is exactly the
sum's digits, so the reward measures both knowing the sum and answering in the asked-for format.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

# A pretrained instruct model, and the renderer that frames its ChatML conversations.
BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"
RENDERER = "smollm2"
PROMPT = "What is {a} + {b}? Respond with a single number and no other text."


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return PROMPT.format(a=self.a, b=self.b)

    @property
    def answer(self) -> str:
        return str(self.a + self.b)

    def is_correct(self, reply: str) -> bool:
        """Exact match: surrounding whitespace is the only thing forgiven."""
        return reply.strip() == self.answer


@dataclass(frozen=True)
class Split:
    train: tuple[Problem, ...]
    held_out: tuple[Problem, ...]


def split_problems(seed: int, held_out_size: int, low: int = 0, high: int = 9) -> Split:
    """Every problem a + b with both operands in [low, high], shuffled by `seed`; the first
    `held_out_size` are held out (never trained on), the rest are the training set."""
    if not 0 <= low <= high:
        raise ValueError(f"operand range must satisfy 0 <= low <= high, got [{low}, {high}]")
    problems = [Problem(a, b) for a in range(low, high + 1) for b in range(low, high + 1)]
    if not 0 < held_out_size < len(problems):
        raise ValueError(
            f"held_out_size must be in (0, {len(problems)}) for operands in [{low}, {high}], got {held_out_size}"
        )
    random.Random(seed).shuffle(problems)
    return Split(train=tuple(problems[held_out_size:]), held_out=tuple(problems[:held_out_size]))


def is_number(reply: str) -> bool:
    """Whether a reply is in the asked-for format (a bare non-negative integer), right or wrong."""
    return reply.strip().isdecimal() and reply.strip().isascii()
