"""The optimizer families a training model may be created with, and the per-step parameters each takes.

The engine runs AdamW (torch.optim.AdamW's update, which the SDK documents as Tinker's). The SDK also
names Dimuon (`DimuonOptimizerConfig`, `DimuonParams`: learning_rate, beta1, grad_clip_norm) but does
not define its update, so a model asking for it is refused at creation: accepting it and running Adam
would train silently with another optimizer.
"""

from __future__ import annotations

from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from tinkerrpc_server.engine.protocol import BadRequest

ADAMW = "adamw"


def check_optimizer_config(config: OptimizerConfigBase | None) -> None:
    """Refuse, before anything is created, a model asking for an optimizer this engine does not run."""
    if config is None or config.type == ADAMW:
        return
    raise BadRequest(
        f"optimizer_config: type {config.type!r} is not supported by this engine, which runs only "
        f"{ADAMW!r} (AdamOptimizerConfig); the SDK does not define the {config.type!r} update"
    )


def adam_params(params: types.OptimParams) -> types.AdamParams:
    """A step's parameters for an AdamW model: every model here is one (see check_optimizer_config)."""
    if isinstance(params, types.AdamParams):
        return params
    raise BadRequest(
        f"optim_params: type {params.type!r} does not match this model's optimizer {ADAMW!r}; give AdamParams"
    )
