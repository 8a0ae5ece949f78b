"""What an engine request's future holds once it has run: a domain answer, which the routes encode when a
client retrieves it (routes/common.py `outcome_response`), never the compute thread.

- a sample request: the runtime's `SampleOutput` (protobuf on the wire);
- forward/forward_backward: the runtime's `ForwardResult` (protobuf on the wire);
- every other operation: the SDK's response model (JSON on the wire).
"""

from __future__ import annotations

from typing import TypeAlias

import pydantic

from tinkerrpc_server.engine.compute.samples import SampleOutput
from tinkerrpc_server.engine.runtime import ForwardResult

Answer: TypeAlias = SampleOutput | ForwardResult | pydantic.BaseModel

# Memory a finished answer holds until the request table forgets it (futures.FutureTable bounds it).
# A list entry of a Python int or float: its 8-byte slot and its 24-28-byte object.
_LISTED_NUMBER_BYTES = 36
# A top-k entry, a (token, logprob) tuple: its slot, the 56-byte tuple and its two numbers.
_TOPK_ENTRY_BYTES = 116
# The SDK's JSON responses hold a path, an id or a few metrics.
_JSON_ANSWER_BYTES = 1024


def answer_size(answer: Answer) -> int:
    """About the bytes of memory `answer` holds (it grows with the tokens and logprobs it carries)."""
    if isinstance(answer, SampleOutput):
        numbers = sum(2 * len(seq.tokens) for seq in answer.sequences)
        numbers += len(answer.prompt_logprobs or ())
        entries = sum(len(row or ()) for row in answer.topk_prompt_logprobs or ())
        arrays = sum(
            seq.topk_logprobs.token_ids.nbytes + seq.topk_logprobs.logprobs.nbytes
            for seq in answer.sequences
            if seq.topk_logprobs is not None
        )
        if answer.target_prompt_logprobs is not None:
            arrays += answer.target_prompt_logprobs.logprobs.nbytes
        return _LISTED_NUMBER_BYTES * numbers + _TOPK_ENTRY_BYTES * entries + arrays
    if isinstance(answer, ForwardResult):
        return sum(array.nbytes for array in answer.logprobs) + _LISTED_NUMBER_BYTES * len(answer.metrics)
    return _JSON_ANSWER_BYTES
