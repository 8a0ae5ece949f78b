"""A decoder's packed weights: the panels' kernel's in one buffer, in a decode step's order, on huge pages."""

from __future__ import annotations

import itertools
import re
from pathlib import Path

import pytest
import torch

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.execution_plan import process_plan
from tinkerrpc_server.engine.compute.packing import huge_page_floats, packed_in_order

pytestmark = pytest.mark.unit

THP_SETTING = Path("/sys/kernel/mm/transparent_hugepage/enabled")


def _panels_or_skip() -> None:
    # The process's plan loads the kernels (built first where needed).
    if not (process_plan().cpu_kernels and cpu_kernels.has_packed_linear()):
        pytest.skip("the panel matmul is built for AVX2 CPUs")


def test_weights_packed_in_order_lie_end_to_end_in_one_buffer() -> None:
    """Each weight's panels follow the one before it in one buffer, as pack_linear_weight lays them out,
    and multiply as they do."""
    _panels_or_skip()
    generator = torch.Generator().manual_seed(0)
    weights = [torch.randn(out, inn, generator=generator) for out, inn in ((50, 37), (96, 576), (576, 96))]
    # One given as the transpose of an (in, out) tensor, as the decoder keeps its projections.
    weights[1] = weights[1].t().contiguous().t()
    packed = packed_in_order(weights, "panels")
    tensors = [p.packed for p in packed if p is not None]
    assert len(tensors) == len(weights)
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    for before, after in itertools.pairwise(tensors):
        assert after.data_ptr() == before.data_ptr() + before.numel() * before.element_size()
    x = torch.randn(3, 576, generator=generator)
    for weight, tensor in zip(weights, tensors, strict=True):
        assert torch.equal(tensor, cpu_kernels.pack_linear_weight(weight))
        rows = x[:, : weight.shape[1]].contiguous()
        assert torch.equal(
            cpu_kernels.packed_linear(rows, tensor, weight.shape[0]),
            cpu_kernels.packed_linear(rows, cpu_kernels.pack_linear_weight(weight), weight.shape[0]),
        )


def test_the_packed_weights_are_offered_huge_pages() -> None:
    """Where transparent huge pages are on for madvise'd memory, the mapping that holds the weights
    packed in order is eligible (and so is any buffer of huge_page_floats)."""
    _panels_or_skip()
    setting = THP_SETTING.read_text() if THP_SETTING.exists() else "[never]"
    if "[never]" in setting:
        pytest.skip(f"transparent huge pages are off here: {setting.strip()}")
    # ~12 MiB of panels: whole 2 MiB blocks inside the buffer wherever it starts.
    (packed,) = packed_in_order([torch.randn(3072, 1024)], "panels")
    assert packed is not None
    assert re.search(r"^THPeligible:\s+1$", _smaps_entry(packed.packed.data_ptr()), re.MULTILINE)
    buffer = huge_page_floats(1 << 20).fill_(1.0)
    assert re.search(r"^THPeligible:\s+1$", _smaps_entry(buffer.data_ptr()), re.MULTILINE)


def _smaps_entry(address: int) -> str:
    """The /proc/self/smaps entry of the mapping holding `address`."""
    for entry in re.split(r"\n(?=[0-9a-f]+-[0-9a-f]+ )", Path("/proc/self/smaps").read_text()):
        start, end = (int(bound, 16) for bound in entry.split(" ", 1)[0].split("-"))
        if start <= address < end:
            return entry
    raise AssertionError(f"no mapping holds {address:#x}")


def test_packing_into_a_buffer_of_another_shape_is_refused_and_writes_nothing() -> None:
    _panels_or_skip()
    weight = torch.randn(50, 37)
    shape = cpu_kernels.packed_weight_shape(50, 37)
    wrong = torch.full([shape[0], shape[1] + 1, *shape[2:]], 7.0)
    with pytest.raises(RuntimeError, match="packed_weight_shape"):
        cpu_kernels.pack_linear_weight_into(weight, wrong)
    assert bool((wrong == 7.0).all())
    with pytest.raises(RuntimeError, match="positive"):
        cpu_kernels.packed_weight_shape(0, 37)


def test_weights_no_packed_kernel_applies_to_are_packed_apart() -> None:
    """A bfloat16 weight among them: it stays unpacked (the decoder multiplies it plainly), the others are
    packed each on its own."""
    _panels_or_skip()
    weights = [torch.randn(32, 16).bfloat16(), torch.randn(16, 32)]
    unpacked, packed = packed_in_order(weights, "panels")
    assert unpacked is None
    assert packed is not None and torch.equal(packed.packed, cpu_kernels.pack_linear_weight(weights[1]))
