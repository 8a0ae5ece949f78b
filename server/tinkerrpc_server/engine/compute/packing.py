"""Prepacked weights for the sampler's decode steps on the CPU, and which kernel packs them here.

A decode step multiplies a few dozen rows by every weight. torch's float32 CPU matmul is MKL's sgemm,
which re-lays the weight on every call; both MKL and oneDNN (in the same torch build) can lay a weight
out once for their kernel instead. Which one is faster depends on the CPU, by a factor: on a 2-core
Intel Xeon MKL's packed kernel was 1.1-1.5x a plain matmul, while on an AMD EPYC MKL runs its generic
code and oneDNN's packed kernel is 3-5x MKL's, plain or packed, for 8-64 rows
(`python -m bench.matmul_kernels`). The engine's own kernel (engine/compute/panel_matmul.cpp, AVX2 and
AVX-512 CPUs) lays a weight out as column panels streamed in order, 6 rows of x at a time in registers
(AVX2) or 16 (AVX-512): with 6 rows, on the EPYC, 1.3-1.6x oneDNN's packed kernel for 1-64 rows over
weights read from memory, ~1.05x at 512; with 16 rows a core runs SmolLM2's and Qwen3's 16-row
projections at 90-105 GFLOP/s, 1.25-1.7x the 6-row kernel. So the engine measures the kernels it has
once per process on one weight (`packing_plan`, called by the execution plan) and packs with the
fastest.

MKL's and oneDNN's packed kernels are torch's private ops (`torch.ops.mkl`, `torch.ops.mkldnn`), no
stable API: a kernel is a candidate only where its ops exist and multiply the probe weight as a plain
matmul does (`usable_kernels`); without any, decoders multiply by plain matmuls.
"""

from __future__ import annotations

import functools
import logging
import math
import mmap
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal

import torch

from tinkerrpc_server.engine.compute import cpu_kernels

log = logging.getLogger(__name__)

Kernel = Literal["mkl", "onednn", "panels"]
# The private ops each of torch's packed kernels needs (the panels' are the engine's own).
_PRIVATE_OPS: dict[Kernel, tuple[tuple[str, str], ...]] = {
    "mkl": (("mkl", "_mkl_reorder_linear_weight"), ("mkl", "_mkl_linear")),
    "onednn": (("mkldnn", "_reorder_linear_weight"), ("mkldnn", "_linear_pointwise")),
    "panels": (),
}
# The row count a packed layout is made for (MKL: the fastest over its rows on the Xeon; oneDNN: a
# 16-row decode step). Both kernels read the layout from the packed buffer, so they multiply any row
# count (tests/engine_core/test_decoder.py checks 1 to 130).
_PACKED_FOR_ROWS: dict[Kernel, int] = {"mkl": 64, "onednn": 16}
# Rows each packed kernel runs once packed. MKL's: 1.1-1.5x a plain matmul for 2-64 rows on the Xeon,
# ~0.9x for one row, even at prefill sizes. oneDNN's on the EPYC: 1.2-1.4x MKL's plain matmul from 128
# to 1,230 rows as well, so prefill takes it too.
# The panels' kernel: every row count.
PACKED_ROWS: dict[Kernel, range] = {
    "mkl": range(2, 65),
    "onednn": range(1, sys.maxsize),
    "panels": range(1, sys.maxsize),
}
# The probe: one SmolLM2-sized gate/up weight at a 16-row decode step, timed in turns; each kernel by its
# fastest run, since other load only ever slows a run down (on a busy 2-core machine a run that waits
# for a core takes a scheduler slice, ~12 ms, against ~0.4 ms: the median picked at random there).
_PROBE_SHAPE = (3072, 576)
_PROBE_ROWS = 16
_PROBE_REPEATS = 15
# Rounds of those runs, a pause apart, each kernel still by its fastest run of all: one round takes ~30
# ms, which one busy moment of the machine can cover (an engine whose probe was one round chose oneDNN's
# kernel over the panels', ~1.3x slower, for its life).
_PROBE_ROUNDS = 3
_PROBE_PAUSE_SECONDS = 0.05
# A kernel's product of the probe may differ from a plain matmul's by float32 rounding in another
# summation order (~1e-6 of its largest value); a broken op is off by order one.
_PROBE_TOLERANCE = 1e-4
# Passes of its rows after which a decoder packs. MKL's: packing SmolLM2's layers took ~0.5 s on the
# Xeon, what ~60 passes of 16 rows save there. oneDNN's: ~0.23 s on the EPYC, what 3-4 passes save,
# so a decoder packs when it is built and computes every pass with one kernel (the same request gives
# the same logprobs in whichever pass of the decoder's life it runs).
PACK_AFTER_PASSES: dict[Kernel, int] = {"mkl": 64, "onednn": 0, "panels": 0}


@dataclass(frozen=True)
class PackingPlan:
    """How this process packs: with `kernel`, used for passes of `rows` rows, once a decoder has run
    `pack_after_passes` such passes (0: when it is built)."""

    kernel: Kernel
    rows: range
    pack_after_passes: int


@dataclass(frozen=True)
class PackedWeight:
    """An (out, in) weight laid out for `kernel`: x · weightᵀ without the layout work on every call.
    Sampling only: the packed kernels have no gradient."""

    kernel: Kernel
    packed: torch.Tensor
    # A zero-stride (out, in) stand-in: MKL's kernel reads its shape and dtype, the panels' kernel its
    # out features (oneDNN's packed buffer carries its shape).
    stand_in: torch.Tensor

    @classmethod
    def of(
        cls, weight: torch.Tensor, kernel: Kernel, into: torch.Tensor | None = None
    ) -> PackedWeight | None:
        """`weight` (out, in) packed for `kernel` (another copy of it in memory: for the panels' kernel
        `into`, where given); None where no packed kernel applies (not a float32 weight on the CPU)."""
        if not packable(weight):
            return None
        stand_in = weight.new_zeros(()).expand(weight.shape)
        if kernel == "panels" and into is not None:
            cpu_kernels.pack_linear_weight_into(weight, into)
            packed = into
        elif kernel == "panels":
            packed = cpu_kernels.pack_linear_weight(weight)
        elif kernel == "mkl":
            packed = torch.ops.mkl._mkl_reorder_linear_weight(weight.contiguous(), _PACKED_FOR_ROWS[kernel])
        else:
            packed = torch.ops.mkldnn._reorder_linear_weight(weight.contiguous(), _PACKED_FOR_ROWS[kernel])
        return cls(kernel, packed, stand_in)

    @property
    def out_features(self) -> int:
        return self.stand_in.shape[0]

    def times(self, x: torch.Tensor) -> torch.Tensor:
        """x · weightᵀ for x (..., in)."""
        product: torch.Tensor
        if self.kernel == "panels":
            flat = x.reshape(-1, x.shape[-1])
            product = cpu_kernels.packed_linear(flat, self.packed, self.out_features)
            product = product.view(*x.shape[:-1], self.out_features)
        elif self.kernel == "mkl":
            rows = x.numel() // x.shape[-1]
            product = torch.ops.mkl._mkl_linear(x, self.packed, self.stand_in, None, rows)
        else:
            product = torch.ops.mkldnn._linear_pointwise(x, self.packed, None, "none", [], "")
        return product


@dataclass(frozen=True)
class DecodingWeight:
    """An (in, out) projection weight as the sampler's decoder multiplies by it: plainly, and once
    packed (`with_packed`) by the plan's packed kernel for the plan's rows."""

    plain: torch.Tensor
    packed: PackedWeight | None = None
    packed_rows: range = range(0)

    def with_packed(self, packed: PackedWeight | None, plan: PackingPlan) -> DecodingWeight:
        """This weight with `packed`, its layout for the plan's kernel (None: none applies)."""
        return DecodingWeight(self.plain, packed, plan.rows)

    def times(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight for x (tokens, in)."""
        if self.packed is None or x.shape[0] not in self.packed_rows:
            return x @ self.plain
        return self.packed.times(x)


def packable(weight: torch.Tensor) -> bool:
    """Whether a packed kernel applies to `weight`: float32, on the CPU."""
    return weight.device.type == "cpu" and weight.dtype == torch.float32


def huge_page_floats(count: int) -> torch.Tensor:
    """`count` zeroed float32s in private anonymous memory that the OS is asked to back with huge pages
    (Linux's transparent huge pages, granted where enabled for `madvise` or `always`, and while free
    2 MiB blocks last; plain pages otherwise). Freed when the last tensor viewing them goes."""
    memory = mmap.mmap(-1, max(1, count) * 4, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):
        memory.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(memory, dtype=torch.float32, count=count)


def packed_in_order(weights: Sequence[torch.Tensor], kernel: Kernel) -> list[PackedWeight | None]:
    """Each (out, in) weight of `weights` packed for `kernel` (`PackedWeight.of`). The panels' kernel's
    lie end to end in one buffer on huge pages, in the order given, the order a decode step reads them:
    its reads then run on from one weight into the next, through fewer page-table entries. Against a
    buffer each on 4 KiB pages: a decode step of SmolLM2's shapes in process 1.06x at 16 rows, 1.02-1.07x
    at one row (`python -m bench.packed_pages`); through the engine +1-6% decode steps/s at 16 rows and
    one row within the host's drift (bench/README.md)."""
    if kernel != "panels" or not all(packable(weight) for weight in weights):
        return [PackedWeight.of(weight, kernel) for weight in weights]
    shapes = [cpu_kernels.packed_weight_shape(*weight.shape) for weight in weights]
    buffer = huge_page_floats(sum(math.prod(shape) for shape in shapes))
    packed: list[PackedWeight | None] = []
    start = 0
    for weight, shape in zip(weights, shapes, strict=True):
        end = start + math.prod(shape)
        packed.append(PackedWeight.of(weight, kernel, buffer[start:end].view(shape)))
        start = end
    return packed


def private_ops_present(namespaced: tuple[tuple[str, str], ...]) -> bool:
    """Whether this torch build registers every (namespace, name) op of `namespaced`."""
    return all(hasattr(getattr(torch.ops, space), name) for space, name in namespaced)


def usable_kernels(panels: bool) -> list[Kernel]:
    """The packed kernels this process has that multiply a probe weight as a plain matmul does: MKL's
    and oneDNN's where this torch build has their ops and backends, the engine's panels with `panels`
    (the CPU kernels loaded, on an AVX2 CPU)."""
    present: dict[Kernel, bool] = {
        "mkl": torch.backends.mkl.is_available() and private_ops_present(_PRIVATE_OPS["mkl"]),  # type: ignore[no-untyped-call]
        "onednn": torch.backends.mkldnn.is_available() and private_ops_present(_PRIVATE_OPS["onednn"]),  # type: ignore[no-untyped-call]
        "panels": panels,
    }
    generator = torch.Generator().manual_seed(1)
    weight = torch.randn(64, 48, generator=generator)
    x = torch.randn(5, 48, generator=generator)
    expected = x @ weight.t()
    return [kernel for kernel, there in present.items() if there and _multiplies(kernel, weight, x, expected)]


def _multiplies(kernel: Kernel, weight: torch.Tensor, x: torch.Tensor, expected: torch.Tensor) -> bool:
    try:
        with torch.inference_mode():
            packed = PackedWeight.of(weight, kernel)
            assert packed is not None  # a float32 CPU weight
            product = packed.times(x)
    except (RuntimeError, TypeError, AttributeError, NotImplementedError) as err:
        log.warning("packed kernel %s unusable with torch %s: %s", kernel, torch.__version__, err)
        return False
    bound = _PROBE_TOLERANCE * float(expected.abs().max())
    if product.shape != expected.shape or float((product - expected).abs().max()) > bound:
        log.warning("packed kernel %s gives wrong products with torch %s", kernel, torch.__version__)
        return False
    return True


def packing_plan(panels: bool) -> PackingPlan | None:
    """The fastest of `usable_kernels(panels)` here, measured on a probe weight; None without any."""
    kernels = usable_kernels(panels)
    if not kernels:
        return None
    generator = torch.Generator().manual_seed(0)
    weight = torch.randn(*_PROBE_SHAPE, generator=generator)
    x = torch.randn(_PROBE_ROWS, _PROBE_SHAPE[1], generator=generator)
    with torch.inference_mode():
        runs: dict[Kernel, Callable[[], torch.Tensor]] = {}
        for kernel in kernels:
            packed = PackedWeight.of(weight, kernel)
            assert packed is not None  # a float32 CPU weight
            runs[kernel] = functools.partial(packed.times, x)
            runs[kernel]()  # a kernel's first call sets it up
        fastest: list[dict[Kernel, float]] = []
        for round_index in range(_PROBE_ROUNDS):
            if round_index:
                time.sleep(_PROBE_PAUSE_SECONDS)
            fastest.append(_fastest_runs(runs))
    best = min(kernels, key=lambda kernel: min(round_[kernel] for round_ in fastest))
    return PackingPlan(best, PACKED_ROWS[best], PACK_AFTER_PASSES[best])


def _fastest_runs(runs: dict[Kernel, Callable[[], torch.Tensor]]) -> dict[Kernel, float]:
    """Each kernel's fastest of `_PROBE_REPEATS` runs, taken in turns (other load on the machine only ever
    slows a run down)."""
    seconds: dict[Kernel, list[float]] = {kernel: [] for kernel in runs}
    for _ in range(_PROBE_REPEATS):
        for kernel, run in runs.items():
            started = time.perf_counter()
            run()
            seconds[kernel].append(time.perf_counter() - started)
    return {kernel: min(times) for kernel, times in seconds.items()}
