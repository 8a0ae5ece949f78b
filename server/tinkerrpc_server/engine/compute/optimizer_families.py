"""The optimizer families a training model is created with (Tinker's `optimizer_config.type`), fixed for
its life: AdamW, torch's (the SDK documents Tinker's as torch.optim.AdamW), and Dimuon.

Dimuon, version 1, as this engine runs it. The tinker 0.38 SDK names its step parameters
(DimuonParams: learning_rate >= 0, beta1 in [0, 1) "EMA coefficient for the momentum", grad_clip_norm)
and no update; Tinker's API reference adds that the learning rate is "applied to a direction with
Frobenius norm sqrt(rank)" and that a matrix-sign iteration count and a normalisation epsilon are
internal constants. From that, per LoRA matrix W (A: rank × in, B: out × rank) with gradient G:

    M ← beta1·M + (1 − beta1)·G                    (the momentum, an EMA; M = 0 before the first step)
    O ← msign(M) = U·Vᵀ for M = U·S·Vᵀ             (the matrix sign: every singular value set to 1)
    W ← W − learning_rate · sqrt(rank) · O / ‖O‖_F  (a direction of Frobenius norm sqrt(rank))

A full-rank M has ‖msign(M)‖_F = sqrt(rank) already; the rescaling matters only when M is rank-deficient.
M = 0 (LoRA A before B has moved) makes no update. msign is computed exactly by SVD, singular values
below MSIGN_RELATIVE_TOLERANCE of the largest counting as 0. Where this may differ from Tinker's
(which publishes no formula): Tinker's later SDKs add a damped row-and-column preconditioner and a rank
learning-rate correction with parameters the 0.38 SDK does not have, so neither is applied here; no
weight decay (DimuonParams has none); plain (not Nesterov) momentum.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable

import torch

ADAMW = "adamw"
DIMUON = "dimuon"
FAMILIES = (ADAMW, DIMUON)
# A singular value of the momentum below this share of its largest is noise: msign maps it to 0.
MSIGN_RELATIVE_TOLERANCE = 1e-6


def matrix_sign(momentum: torch.Tensor) -> torch.Tensor:
    """U·Vᵀ of the thin SVD of a 2-D tensor (its polar factor), 0 on the directions of ~0 singular value."""
    u, s, vh = torch.linalg.svd(momentum.double(), full_matrices=False)
    kept = (s > s.max() * MSIGN_RELATIVE_TOLERANCE).to(u.dtype) if s.numel() else s
    sign: torch.Tensor = ((u * kept) @ vh).to(momentum.dtype)
    return sign


def dimuon_direction(momentum: torch.Tensor) -> torch.Tensor:
    """msign of a LoRA matrix's momentum scaled to Frobenius norm sqrt(rank), rank = its smaller side;
    a tensor of another shape is taken as one row (its direction, norm 1)."""
    matrix = momentum if momentum.dim() == 2 else momentum.reshape(1, -1)
    sign = matrix_sign(matrix)
    norm = torch.linalg.matrix_norm(sign)
    if norm == 0:
        return torch.zeros_like(momentum)
    direction: torch.Tensor = (sign * (math.sqrt(min(matrix.shape)) / norm)).reshape(momentum.shape)
    return direction


class Dimuon(torch.optim.Optimizer):
    """Dimuon v1 (the module docstring); its state per parameter: `step` and `momentum_buffer`."""

    def __init__(self, params: Iterable[torch.nn.Parameter], lr: float = 0.0, beta1: float = 0.9) -> None:
        super().__init__(params, {"lr": lr, "beta1": beta1})

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None) -> None:  # type: ignore[override]
        """One step of every parameter with a gradient (no closure: the engine computes gradients first)."""
        for group in self.param_groups:
            lr, beta1 = group["lr"], group["beta1"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["momentum_buffer"] = torch.zeros_like(param)
                momentum = state["momentum_buffer"]
                momentum.mul_(beta1).add_(param.grad, alpha=1 - beta1)
                state["step"] += 1
                param.sub_(dimuon_direction(momentum), alpha=lr)


def new_optimizer(family: str, params: list[torch.nn.Parameter]) -> torch.optim.Optimizer:
    """A fresh optimizer of `family` over `params` (its step parameters are set at each step)."""
    if family == ADAMW:
        return torch.optim.AdamW(params, lr=0.0)
    if family == DIMUON:
        return Dimuon(params)
    raise ValueError(f"unknown optimizer family {family!r}; expected one of {FAMILIES}")


def family_of(optimizer: torch.optim.Optimizer) -> str:
    return DIMUON if isinstance(optimizer, Dimuon) else ADAMW
