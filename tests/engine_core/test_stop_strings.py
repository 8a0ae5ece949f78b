"""Stop strings are checked on the tail of a row that can hold a new match, with the result of decoding the
whole row at every step: a match spanning token boundaries, or completing a character split over byte
tokens, is found at the token that completes it, and each step decodes a bounded number of tokens."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.compute.token_choice import StopCheck
from tinkerrpc_server.engine.runtime import BaseModelRuntime

pytestmark = pytest.mark.unit

LENGTH = 80


class CountingTokenizer:
    """The runtime's tokenizer, counting the tokens each decode call is given."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.decoded: list[int] = []

    def decode(self, tokens: list[int]) -> str:
        self.decoded.append(len(tokens))
        return str(self.tokenizer.decode(tokens))


def first_stop_by_whole_text(tokenizer: Any, tokens: list[int], stops: list[str]) -> int | None:
    """The length at which the whole row's text first contains a stop string (the definition)."""
    for end in range(1, len(tokens) + 1):
        text = tokenizer.decode(tokens[:end])
        if any(stop in text for stop in stops):
            return end
    return None


def first_stop_by_check(check: StopCheck, tokens: list[int]) -> int | None:
    for end in range(1, len(tokens) + 1):
        if check.reason(tokens[:end]) == "stop":
            return end
    return None


def spanning_stop(tokenizer: Any, tokens: list[int], boundary: int, before: int, after: int) -> str:
    """The text from `before` characters before the end of token `boundary` to `after` after it."""
    head = tokenizer.decode(tokens[:boundary])
    whole = tokenizer.decode(tokens)
    return str(whole[max(0, len(head) - before) : len(head) + after])


@pytest.mark.parametrize("seed", range(12))
def test_the_tail_check_stops_where_the_whole_text_does(runtime: BaseModelRuntime, seed: int) -> None:
    tokenizer = runtime.tokenizer
    rng = np.random.default_rng(seed)
    tokens = [int(t) for t in rng.integers(0, runtime.vocab_size, LENGTH)]
    boundary = int(rng.integers(LENGTH // 2, LENGTH - 4))
    stops = [
        spanning_stop(tokenizer, tokens, boundary, int(rng.integers(1, 6)), int(rng.integers(1, 6))),
        "never-produced-xyz",
    ]
    assert stops[0], "the stop string is empty"
    expected = first_stop_by_whole_text(tokenizer, tokens, stops)
    assert expected is not None
    counting = CountingTokenizer(tokenizer)
    job = SampleJob([1], 1, LENGTH + 1, stop_strings=stops)
    check = StopCheck(job, frozenset(), counting)
    assert first_stop_by_check(check, tokens) == expected
    if check.tail_tokens is not None:
        # Incremental: no step decodes more than the tail, however long the row.
        assert max(counting.decoded) <= check.tail_tokens < LENGTH // 2


def test_a_stop_string_split_over_tokens_is_found_at_the_completing_token(runtime: BaseModelRuntime) -> None:
    tokenizer = runtime.tokenizer
    rng = np.random.default_rng(99)
    tokens = [int(t) for t in rng.integers(0, runtime.vocab_size, LENGTH)]
    # Both sides of the boundary between tokens 60 and 61, far past the start of the row.
    stop = spanning_stop(tokenizer, tokens, 60, 3, 2)
    expected = first_stop_by_whole_text(tokenizer, tokens, [stop])
    assert expected is not None and expected > 40
    counting = CountingTokenizer(tokenizer)
    check = StopCheck(SampleJob([1], 1, LENGTH + 1, stop_strings=[stop]), frozenset(), counting)
    assert first_stop_by_check(check, tokens) == expected
    assert check.tail_tokens is not None
    assert len(counting.decoded) == expected and max(counting.decoded) <= check.tail_tokens


def test_stop_tokens_and_max_tokens(runtime: BaseModelRuntime) -> None:
    check = StopCheck(SampleJob([1], 1, 3), frozenset({7}), runtime.tokenizer)
    assert [check.reason([5]), check.reason([5, 7]), check.reason([5, 6, 8])] == [None, "stop", "length"]
