"""The optimizer families a training model may be created with, as the SDK names them, and its steps'
parameters dispatched to the family's step.

AdamW (`AdamOptimizerConfig`, `AdamParams`) is torch.optim.AdamW's update, which the SDK documents as
Tinker's. Dimuon (`DimuonOptimizerConfig` version 1, `DimuonParams`) is the update
compute/optimizer_families.py states, inferred from the SDK and Tinker's API reference (which publish
no formula): docs/tinker_parity.md says what is inferred. A model's family is fixed at its creation; a
step of another family's parameters is refused in its turn and changes nothing.
"""

from __future__ import annotations

from pathlib import Path

import pydantic
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase, OptimParamsBase

from tinkerrpc_server.engine.compute.optimizer_families import ADAMW, DIMUON
from tinkerrpc_server.engine.compute.state_io import saved_optimizer
from tinkerrpc_server.engine.protocol import BadRequest
from tinkerrpc_server.engine.runtime import BaseModelRuntime

DIMUON_VERSION = 1


def optimizer_family(config: OptimizerConfigBase | None) -> str | None:
    """The family an optimizer_config selects (None when none is given), refused before anything is
    created when this engine does not run it."""
    if config is None:
        return None
    if config.type == ADAMW:
        return ADAMW
    if config.type == DIMUON:
        version = (config.model_extra or {}).get("version", DIMUON_VERSION)
        if version != DIMUON_VERSION:
            raise BadRequest(
                f"optimizer_config: Dimuon version {version!r} is not supported (this engine runs 1)"
            )
        return DIMUON
    raise BadRequest(
        f"optimizer_config: type {config.type!r} is not supported by this engine, which runs "
        f"{ADAMW!r} (AdamOptimizerConfig) and {DIMUON!r} (DimuonOptimizerConfig)"
    )


def saved_optimizer_config(directory: Path) -> types.OptimizerConfig:
    """The optimizer_config of the run that saved the checkpoint at `directory` (weights_info's)."""
    if saved_optimizer(directory) == DIMUON:
        return types.DimuonOptimizerConfig()
    return types.AdamOptimizerConfig()


def optim_step(runtime: BaseModelRuntime, model_id: str, params: types.OptimParams) -> dict[str, float]:
    """Run a step of `params`' family on `model_id` (compute thread); the runtime refuses a family that is
    not the model's."""
    if isinstance(params, types.AdamParams):
        return runtime.optim_step(
            model_id,
            learning_rate=params.learning_rate,
            beta1=params.beta1,
            beta2=params.beta2,
            eps=params.eps,
            weight_decay=params.weight_decay,
            grad_clip_norm=params.grad_clip_norm,
        )
    if isinstance(params, OptimParamsBase) and params.type == DIMUON:
        try:
            dimuon = types.DimuonParams.model_validate(params.model_dump())
        except pydantic.ValidationError as error:
            problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
            raise BadRequest(f"optim_params: invalid DimuonParams ({problems})") from None
        return runtime.dimuon_step(
            model_id,
            learning_rate=dimuon.learning_rate,
            beta1=dimuon.beta1,
            grad_clip_norm=dimuon.grad_clip_norm,
        )
    raise BadRequest(
        f"optim_params: type {getattr(params, 'type', None)!r} is not an optimizer this engine runs; "
        "give AdamParams or DimuonParams, as the model was created with"
    )
