"""The engine's resident memory follows what it uses: after a training step or a sample batch, the free
memory malloc keeps resident past HEAP_SLACK_BYTES goes back to the operating system.

A training step's activations and a sample batch's logits and KV cache are transient and big: on
SmolLM2 in float32, a `forward_backward` of 32 datums of 40-70 tokens left the process 4.0 GB larger
than before it, with 46 MB more in use. Their tensors are mostly a few MB, which glibc's malloc serves
from its arenas once it has seen such blocks freed (its mmap threshold rises up to 32 MB); what stays
after the step (gradients, results) pins the arenas' pages, so malloc keeps them for later use and the
process held the largest peak it ever reached: 6.7 GB in the arithmetic demo after four policy
versions, 8.5 GB in distillation, where one run was OOM-killed. Not the sampler's weight copies: at
most SAMPLER_CACHE_SIZE sampler adapters and one merged decoder are held (compute/sampling.py).

Each step's own peak stays what its micro-batches make it (compute/training.py); what stays after it
is at most the slack, which a next operation of about the same size reuses without faulting pages in.
Elsewhere than glibc (musl, macOS) this does nothing: those allocators return memory in their own way.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

Params = ParamSpec("Params")
Result = TypeVar("Result")

# Free resident memory malloc may keep after an operation. Trimming costs the trim itself (0.36 s after
# a 16-datum SmolLM2 step, walking the arenas) and the next operation's page faults on what it gave
# back: a few % of a SmolLM2 training step (10-40 s on 2 cores); below this much, keeping it is cheaper.
HEAP_SLACK_BYTES = 512 * 2**20


class _MallInfo2(ctypes.Structure):
    """glibc's `struct mallinfo2` (glibc 2.33+)."""

    _fields_ = [
        (name, ctypes.c_size_t)
        for name in (
            "arena",
            "ordblks",
            "smblks",
            "hblks",
            "hblkhd",
            "usmblks",
            "fsmblks",
            "uordblks",
            "fordblks",
            "keepcost",
        )
    ]


def _glibc() -> Any | None:
    """The process's C library when it is glibc with mallinfo2 and malloc_trim, else None."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None)
        libc.mallinfo2.restype = _MallInfo2
        libc.malloc_trim.argtypes = [ctypes.c_size_t]
        libc.malloc_trim.restype = ctypes.c_int
    except (OSError, AttributeError):
        return None
    return libc


_LIBC = _glibc()


def resident_free_bytes() -> int | None:
    """Resident bytes malloc holds free (None: not glibc on Linux): the anonymous resident memory less
    what malloc has in use. Python's own small-object arenas count as free here (tens of MB); malloc's
    own count of free bytes would not do, since it still counts pages it gave back."""
    if _LIBC is None:
        return None
    with open("/proc/self/status") as status:
        resident = next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))
    info = _LIBC.mallinfo2()
    return max(0, resident - int(info.uordblks) - int(info.hblkhd))


def return_freed_memory(slack: int = HEAP_SLACK_BYTES) -> bool:
    """Give malloc's free pages back to the operating system when more than `slack` bytes of them are
    resident; whether it did."""
    free = resident_free_bytes()
    if _LIBC is None or free is None or free <= slack:
        return False
    _LIBC.malloc_trim(0)
    return True


def returns_freed_memory(call: Callable[Params, Result]) -> Callable[Params, Result]:
    """`call`, followed by `return_freed_memory()` once it has returned (its locals are gone by then)."""

    @functools.wraps(call)
    def wrapped(*args: Params.args, **kwargs: Params.kwargs) -> Result:
        try:
            return call(*args, **kwargs)
        finally:
            return_freed_memory()

    return wrapped
