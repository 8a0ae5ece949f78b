"""The optimizer step of one adapter's LoRA weights, by its optimizer family (AdamW or Dimuon,
optimizer_families.py): refused when the step's parameters are out of range or of another family, and
when the loss, the gradients, or what the step would leave are not finite; a refused step leaves the
weights and optimizer state as before."""

from __future__ import annotations

import math

import torch

from tinkerrpc_server.engine.compute.adapters import AdaptedModel, Adapter
from tinkerrpc_server.engine.compute.errors import EngineUserError, NonFiniteUpdateError
from tinkerrpc_server.engine.compute.optimizer_families import ADAMW, DIMUON


class OptimizerSteps(AdaptedModel):
    """Optimizer steps of an adapter, refused (and undone) when not finite."""

    def optim_step(
        self,
        model_id: str,
        learning_rate: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, float]:
        adapter = self._require_adapter(model_id)
        checks = {
            "learning_rate": learning_rate >= 0,
            "beta1": 0 <= beta1 < 1,
            "beta2": 0 <= beta2 < 1,
            "eps": eps >= 0,
            "weight_decay": weight_decay >= 0,
            "grad_clip_norm": grad_clip_norm >= 0,
        }
        values = {
            "learning_rate": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_clip_norm": grad_clip_norm,
        }
        for name, ok in checks.items():
            if not (ok and math.isfinite(values[name])):
                raise EngineUserError(f"invalid AdamParams.{name}: {values[name]}")
        self._require_family(adapter, ADAMW, "AdamParams")
        return self._step(
            adapter, grad_clip_norm, learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay
        )

    def dimuon_step(
        self, model_id: str, learning_rate: float, beta1: float, grad_clip_norm: float
    ) -> dict[str, float]:
        """A Dimuon step; `grad_clip_norm` <= 0 leaves the gradients unclipped (DimuonParams')."""
        adapter = self._require_adapter(model_id)
        values = {"learning_rate": learning_rate, "beta1": beta1, "grad_clip_norm": grad_clip_norm}
        checks = {"learning_rate": learning_rate >= 0, "beta1": 0 <= beta1 < 1, "grad_clip_norm": True}
        for name, ok in checks.items():
            if not (ok and math.isfinite(values[name])):
                raise EngineUserError(f"invalid DimuonParams.{name}: {values[name]}")
        self._require_family(adapter, DIMUON, "DimuonParams")
        return self._step(adapter, max(grad_clip_norm, 0.0), learning_rate, beta1=beta1)

    @staticmethod
    def _require_family(adapter: Adapter, family: str, params_type: str) -> None:
        if adapter.spec.optimizer != family:
            raise EngineUserError(
                f"optim_params: type {family!r} ({params_type}) does not match this model's optimizer "
                f"{adapter.spec.optimizer!r}, chosen at its creation; give its parameters"
            )

    def _step(
        self, adapter: Adapter, grad_clip_norm: float, learning_rate: float, **settings: object
    ) -> dict[str, float]:
        """A step at `learning_rate` under the family's other per-step `settings`, the gradients
        clipped to a global norm of `grad_clip_norm` when it is > 0."""
        params = list(adapter.params.values())
        for param in params:
            # No forward_backward since the last step still makes a step (of decay, or momentum, alone).
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if adapter.non_finite_loss or not math.isfinite(grad_norm):
            self._discard_gradients(adapter)
            raise NonFiniteUpdateError(
                f"the loss or gradients since the last step are not finite (gradient norm {grad_norm})"
            )
        before = _snapshot(adapter)
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip_norm, torch.tensor(grad_norm))
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, **settings)
        try:
            adapter.optimizer.step()
            finite = _all_finite(adapter)
        except RuntimeError as error:
            # torch stops mid-step when a scaled value overflows float (some parameters already moved).
            _restore(adapter, before)
            self._discard_gradients(adapter)
            if "overflow" not in str(error):
                raise
            raise NonFiniteUpdateError(f"the update overflows float32 ({error})") from None
        if not finite:
            _restore(adapter, before)
            self._discard_gradients(adapter)
            raise NonFiniteUpdateError("the updated weights or optimizer state are not finite")
        adapter.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": learning_rate}

    @staticmethod
    def _discard_gradients(adapter: Adapter) -> None:
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.non_finite_loss = False


# What an optimizer step changes, per parameter: its value and its optimizer state (None before its first step).
_Snapshot = list[tuple[torch.nn.Parameter, torch.Tensor, dict[str, torch.Tensor] | None]]


def _snapshot(adapter: Adapter) -> _Snapshot:
    """A copy of the LoRA weights and optimizer state (small beside the base model) to undo a step."""
    saved: _Snapshot = []
    for param in adapter.params.values():
        state = adapter.optimizer.state.get(param)
        state_copy = {key: value.clone() for key, value in state.items()} if state else None
        saved.append((param, param.detach().clone(), state_copy))
    return saved


def _restore(adapter: Adapter, saved: _Snapshot) -> None:
    with torch.no_grad():
        for param, value, state in saved:
            param.copy_(value)
            if state is None:
                adapter.optimizer.state.pop(param, None)
            else:
                adapter.optimizer.state[param] = state


def _all_finite(adapter: Adapter) -> bool:
    tensors = [p.detach() for p in adapter.params.values()]
    for state in adapter.optimizer.state.values():
        tensors.extend(v for key, v in state.items() if key != "step")
    # One device sync for all of them.
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())
