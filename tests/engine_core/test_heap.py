"""The engine's resident memory follows what it uses (engine/compute/heap.py): the pages of a burst of
few-MB tensors freed around tensors that stay (a training step's activations around the gradients it
leaves) are kept by glibc's malloc, and go back to the system once more than HEAP_SLACK_BYTES is free.
Real torch tensors on a thread of their own, like the engine's compute thread."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TypeVar

import psutil
import pytest
import torch

from tinkerrpc_server.engine.compute.heap import HEAP_SLACK_BYTES, resident_free_bytes, return_freed_memory

pytestmark = pytest.mark.unit

BLOCK_BYTES = 4 * 2**20  # a SmolLM2 activation or merged projection is 1-7 MB
BURST_BYTES = 3 * HEAP_SLACK_BYTES
KEPT_BYTES = 64 * 2**10  # what stays after each block (a gradient, a result)

Result = TypeVar("Result")


def _on_a_thread(call: Callable[[], Result]) -> Result:
    results: list[Result] = []
    thread = threading.Thread(target=lambda: results.append(call()))
    thread.start()
    thread.join()
    return results[0]


def _rss() -> int:
    return int(psutil.Process().memory_info().rss)


def _floats(nbytes: int) -> torch.Tensor:
    return torch.ones(nbytes // 4)


def _burst() -> tuple[int, int, int, bool, int, list[torch.Tensor]]:
    """RSS before a burst, at its peak, once freed, whether return_freed_memory gave pages back, and RSS
    after; the tensors that stayed."""
    # A freed mmapped block raises glibc's mmap threshold to its size (the engine's first frees do),
    # so blocks this size come from the arena from then on.
    del_first = _floats(2 * BLOCK_BYTES)
    del del_first
    before = _rss()
    blocks, kept = [], []
    for _ in range(BURST_BYTES // BLOCK_BYTES):
        blocks.append(_floats(BLOCK_BYTES))
        kept.append(_floats(KEPT_BYTES))
    peak = _rss()
    del blocks
    held = _rss()
    returned = return_freed_memory()
    return before, peak, held, returned, _rss(), kept


@pytest.mark.skipif(resident_free_bytes() is None, reason="malloc is not glibc's here")
def test_a_freed_burst_goes_back_to_the_system_past_the_slack() -> None:
    before, peak, held, returned, after, kept = _on_a_thread(_burst)
    assert peak - before > 0.9 * BURST_BYTES
    # Without the trim the process keeps the burst: the tensors that stayed pin the arena's pages.
    assert held - before > BURST_BYTES - HEAP_SLACK_BYTES
    assert returned
    assert after - before < HEAP_SLACK_BYTES
    assert all(float(t[0]) == 1.0 for t in kept)  # what stayed is intact


@pytest.mark.skipif(resident_free_bytes() is None, reason="malloc is not glibc's here")
def test_free_memory_within_the_slack_stays() -> None:
    def small_burst() -> tuple[bool, int | None]:
        blocks = [_floats(BLOCK_BYTES) for _ in range(4)]
        del blocks
        return_freed_memory()  # whatever earlier tests left
        return return_freed_memory(), resident_free_bytes()

    returned, free = _on_a_thread(small_burst)
    assert not returned
    assert free is not None and free <= HEAP_SLACK_BYTES
