"""How this process runs the sampler's forward on its hardware: chosen once per process and handed to
every decoder, the one place that decides which kernels run.

- the engine's fused CPU kernels (cpu_kernels.py) for a float32 CPU pass outside autograd, where the
  settings allow them and they build;
- which packed matmul kernel serves the sampler's projections and unembedding (packing.py), measured
  here;
- whether a decode step's unembedding runs oneDNN's inner product instead of MKL's sgemm (`unembed`).

MKL's and oneDNN's kernels are torch's private ops (`torch.ops.mkl`, `torch.ops.mkldnn`), no stable API:
each is used only where this process's torch has it and a probe gets a plain matmul's numbers from it;
elsewhere torch's public ops run, as under `TORCH_OPS`, the plan that uses none of the three
(tests/engine_core/test_execution_plan.py checks the decoder on it against the chosen plan and
transformers).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.packing import PackingPlan, packing_plan, private_ops_present
from tinkerrpc_server.settings import KernelSettings

log = logging.getLogger(__name__)

# Rows of a decode step whose unembedding goes through oneDNN (see ExecutionPlan.unembed).
ONEDNN_UNEMBEDDING_ROWS = range(8, 65)
_ONEDNN_LINEAR = (("mkldnn", "_linear_pointwise"),)


@dataclass(frozen=True)
class ExecutionPlan:
    """Which kernels the sampler's decoders run in this process."""

    # The fused CPU kernels are loaded (a pass still runs them only where `fused_kernels_for` says so).
    cpu_kernels: bool
    # How decoders pack their projections and unembedding; None: plain matmuls throughout.
    packing: PackingPlan | None
    # A decode step's float32 CPU unembedding runs oneDNN's inner product.
    onednn_unembedding: bool

    def fused_kernels_for(self, weight: torch.Tensor) -> bool:
        """Whether a pass over `weight` runs on the fused CPU kernels: float32 on the CPU, no autograd (they
        have no backward), and the kernels loaded. The learner's forward never asks: it stays on torch ops,
        so a datum's logprobs are the same whether or not its call trains."""
        return (
            self.cpu_kernels
            and weight.device.type == "cpu"
            and weight.dtype == torch.float32
            and not torch.is_grad_enabled()
        )

    def unembed(self, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """hidden · weightᵀ for the (vocabulary, hidden) unembedding. On the CPU in float32, torch's matmul
        is MKL's sgemm, whose kernel for a few dozen rows against a (vocabulary, hidden) weight (the
        transposed operand) takes up to 2-2.8x the time of oneDNN's inner product in the same torch build;
        below 8 rows and at prefill sizes they are about even (`python -m bench.matmul_kernels`). oneDNN
        reads the weight as stored, without a packed copy. Only the sampler calls this, without grad
        (oneDNN's kernel has none). The layers' (in, out) weights stay on MKL until packed: oneDNN re-lays
        that layout on every call."""
        rows = hidden.numel() // hidden.shape[-1]
        if (
            self.onednn_unembedding
            and rows in ONEDNN_UNEMBEDDING_ROWS
            and hidden.device.type == "cpu"
            and hidden.dtype == weight.dtype == torch.float32
            and weight.is_contiguous()
            and not torch.is_grad_enabled()
        ):
            flat = hidden.reshape(rows, hidden.shape[-1])
            logits: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, weight, None, "none", [], "")
            return logits.view(*hidden.shape[:-1], weight.shape[0])
        return F.linear(hidden, weight)


# torch's public ops only: no CPU kernels, no packing, no private op.
TORCH_OPS = ExecutionPlan(cpu_kernels=False, packing=None, onednn_unembedding=False)

_lock = threading.Lock()
_chosen: tuple[KernelSettings, ExecutionPlan] | None = None


def choose_execution_plan(settings: KernelSettings) -> ExecutionPlan:
    """This process's plan under `settings`: chosen on the first call (the CPU kernels built and loaded,
    the packed kernels probed and timed, ~1 s), the same plan on every later call. The kernels, once
    loaded, are the process's: a second call with other settings is an error."""
    global _chosen
    with _lock:
        if _chosen is None:
            loaded = cpu_kernels.load(settings)
            plan = ExecutionPlan(
                cpu_kernels=loaded,
                packing=packing_plan(panels=loaded and cpu_kernels.has_packed_linear()),
                onednn_unembedding=_onednn_unembedding_works(),
            )
            _chosen = (settings, plan)
            log.info(
                "execution plan: CPU kernels %s, packed kernel %s, oneDNN unembedding %s",
                "on" if plan.cpu_kernels else "off",
                plan.packing.kernel if plan.packing is not None else "none",
                "on" if plan.onednn_unembedding else "off",
            )
        chosen_settings, plan = _chosen
    if chosen_settings != settings:
        raise ValueError(f"this process's execution plan was chosen under {chosen_settings}, not {settings}")
    return plan


def process_plan() -> ExecutionPlan:
    """The plan this process chose, or the one chosen now under the default settings where its entry
    point chose none (tests and benchmarks that build a runtime in process)."""
    chosen = _chosen
    return chosen[1] if chosen is not None else choose_execution_plan(KernelSettings())


def _onednn_unembedding_works() -> bool:
    """Whether oneDNN's inner product is there and multiplies a probe as F.linear does."""
    if not (torch.backends.mkldnn.is_available() and private_ops_present(_ONEDNN_LINEAR)):  # type: ignore[no-untyped-call]
        return False
    generator = torch.Generator().manual_seed(2)
    weight = torch.randn(40, 24, generator=generator)
    hidden = torch.randn(ONEDNN_UNEMBEDDING_ROWS.start, 24, generator=generator)
    try:
        with torch.inference_mode():
            product = torch.ops.mkldnn._linear_pointwise(hidden, weight, None, "none", [], "")
    except (RuntimeError, TypeError, AttributeError, NotImplementedError):
        return False
    expected = F.linear(hidden, weight)
    return product.shape == expected.shape and bool(torch.allclose(product, expected, rtol=1e-4, atol=1e-5))
