"""Addition problems with an exact checker, split from a seed into a training set and a held-out set.

The prompt states the answer format, the problem's equation completed with its sum ("3 + 4 = 7"): a
small model adds far more reliably when it writes the equation out than when it must name the sum in
one go. A reply is correct only when it is exactly that line, so the reward measures both the sum and
the asked-for format.
"""

from __future__ import annotations

import random
import re
from dataclasses import dataclass

from tinkerrpc_server.model_store import SMOLLM2_135M_INSTRUCT

# A pretrained instruct model, and the renderer that frames its ChatML conversations.
BASE_MODEL = SMOLLM2_135M_INSTRUCT
RENDERER = "smollm2"
PROMPT = "What is {a} + {b}? Respond with a single line of the form {a} + {b} = <sum> and no other text."


@dataclass(frozen=True)
class Problem:
    a: int
    b: int

    @property
    def prompt(self) -> str:
        return PROMPT.format(a=self.a, b=self.b)

    @property
    def answer(self) -> str:
        return f"{self.a} + {self.b} = {self.a + self.b}"

    def is_correct(self, reply: str) -> bool:
        """Exact match: surrounding whitespace is the only thing forgiven."""
        return reply.strip() == self.answer

    def is_in_format(self, reply: str) -> bool:
        """Whether a reply is this problem's equation with some sum, right or wrong."""
        return re.fullmatch(rf"{self.a} \+ {self.b} = [0-9]+", reply.strip()) is not None


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
