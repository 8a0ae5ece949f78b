"""Where the engine computes: its torch device and the dtype of its base weights."""

from __future__ import annotations

import torch

from tinkerrpc_server.settings import ENGINE_DTYPES


class PlacementError(ValueError):
    """An engine device or base-weight dtype this machine cannot run; the message says which and why."""


def resolve_placement(
    device: str | None = None, dtype: str | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device and base-weight dtype of the engine: the arguments (None: the default), by default CUDA
    when there is one, bfloat16 on CUDA, float32 elsewhere.

    bfloat16 halves the base model's memory and runs on the GPU's tensor cores; float32 stays the CPU
    default, where bfloat16 matmuls are no faster and the reference tests compare float32 numerics.
    """
    device = device or None
    dtype = dtype or None
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise PlacementError(f"engine device {device!r} is not a torch device: {error}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(
                f"engine device {device!r}: this machine has no usable CUDA device "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise PlacementError(
                f"engine device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif resolved.type != "cpu":
        raise PlacementError(f"engine device {device!r}: the engine runs on cpu or cuda")
    if dtype is None:
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    if dtype not in ENGINE_DTYPES:
        raise PlacementError(f"engine dtype {dtype!r}: expected one of {', '.join(ENGINE_DTYPES)}")
    return resolved, getattr(torch, dtype)
