"""The runtime's non-finite guard: an optimizer step whose loss or gradients since the last step, or whose
updated weights, are not finite is refused, and the adapter keeps its weights and optimizer state exactly
(the next step equals a twin's that never saw the refused one)."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from tinker import types

from tinkerrpc_server.engine.routes.common import outcome_response
from tinkerrpc_server.engine.runtime import (
    NON_FINITE_UPDATE,
    BaseModelRuntime,
    DatumArrays,
    LoraSpec,
    NonFiniteUpdateError,
)

pytestmark = pytest.mark.unit

ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.01,
    "grad_clip_norm": 1.0,
}
_ids = itertools.count()


def twins(runtime: BaseModelRuntime) -> tuple[str, str]:
    """Two adapters with the same non-zero weights (a fresh lora_B is zero: every factor gets a gradient)."""
    names = []
    for _ in range(2):
        model_id = f"guard-{next(_ids)}"
        runtime.create_adapter(model_id, LoraSpec(rank=4, seed=3))
        generator = torch.Generator().manual_seed(11)
        with torch.no_grad():
            for param in runtime.adapter_parameters(model_id).values():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        names.append(model_id)
    return names[0], names[1]


def rl_datum(runtime: BaseModelRuntime, sampler_logprob: float) -> DatumArrays:
    rng = np.random.default_rng(5)
    tokens = rng.integers(0, runtime.vocab_size, 9)
    return DatumArrays(
        tokens[:-1],
        {
            "target_tokens": tokens[1:],
            "logprobs": np.full(8, sampler_logprob, dtype=np.float32),
            "advantages": np.linspace(-1.0, 1.0, 8, dtype=np.float32),
        },
    )


def train_step(
    runtime: BaseModelRuntime, model_id: str, sampler_logprob: float = -2.0, **adam: float
) -> None:
    runtime.forward_backward(
        model_id, [rl_datum(runtime, sampler_logprob)], "importance_sampling", None, backward=True
    )
    runtime.optim_step(model_id, **{**ADAM, **adam})


def state_of(runtime: BaseModelRuntime, model_id: str) -> dict[str, torch.Tensor]:
    """Weights and AdamW moments by name."""
    adapter = runtime._adapters[model_id]
    state: dict[str, torch.Tensor] = {}
    for name, param in adapter.params.items():
        state[name] = param.detach().clone()
        for key, value in adapter.optimizer.state.get(param, {}).items():
            state[f"{name}.{key}"] = value.clone()
    return state


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name


def test_overflowing_importance_ratios_are_refused_and_change_nothing(runtime: BaseModelRuntime) -> None:
    poisoned, twin = twins(runtime)
    for model_id in (poisoned, twin):
        train_step(runtime, model_id)
    before = state_of(runtime, poisoned)

    # Sampler logprobs of -1e4 are in the server's range, but exp(logp + 1e4) overflows float32.
    result = runtime.forward_backward(
        poisoned, [rl_datum(runtime, -1e4)], "importance_sampling", None, backward=True
    )
    assert not np.isfinite(result.metrics["loss:sum"])
    with pytest.raises(NonFiniteUpdateError, match=f"^{NON_FINITE_UPDATE}: the loss or gradients"):
        runtime.optim_step(poisoned, **ADAM)

    assert_same(state_of(runtime, poisoned), before)
    assert all(p.grad is None for p in runtime.adapter_parameters(poisoned).values())
    for model_id in (poisoned, twin):
        train_step(runtime, model_id)
    assert_same(state_of(runtime, poisoned), state_of(runtime, twin))


def test_an_update_that_overflows_is_undone(runtime: BaseModelRuntime) -> None:
    poisoned, twin = twins(runtime)
    for model_id in (poisoned, twin):
        train_step(runtime, model_id)
    before = state_of(runtime, poisoned)

    # Finite gradients, but a learning rate (beyond the server's bound) whose step overflows float32:
    # torch raises mid-step, after some parameters already moved.
    with pytest.raises(NonFiniteUpdateError, match="the update overflows float32"):
        train_step(runtime, poisoned, learning_rate=1e39, grad_clip_norm=0.0)

    assert_same(state_of(runtime, poisoned), before)
    for model_id in (poisoned, twin):
        train_step(runtime, model_id)
    assert_same(state_of(runtime, poisoned), state_of(runtime, twin))


def test_updated_weights_past_float32_are_undone(runtime: BaseModelRuntime) -> None:
    (model_id, _) = twins(runtime)
    train_step(runtime, model_id)
    runtime.forward_backward(model_id, [rl_datum(runtime, -2.0)], "importance_sampling", None, backward=True)
    # Weights at the edge of float32 (set after the gradients, which stay finite): a step of 1e36
    # takes some of them to infinity without torch raising.
    with torch.no_grad():
        next(iter(runtime.adapter_parameters(model_id).values())).fill_(3.4e38)
    before = state_of(runtime, model_id)

    with pytest.raises(NonFiniteUpdateError, match="updated weights or optimizer state are not finite"):
        runtime.optim_step(model_id, **{**ADAM, "learning_rate": 1e36, "weight_decay": 0.0})

    assert_same(state_of(runtime, model_id), before)
    assert all(p.grad is None for p in runtime.adapter_parameters(model_id).values())


def test_a_first_step_that_overflows_leaves_no_optimizer_state(runtime: BaseModelRuntime) -> None:
    poisoned, twin = twins(runtime)
    with pytest.raises(NonFiniteUpdateError):
        train_step(runtime, poisoned, learning_rate=1e39, grad_clip_norm=0.0)
    assert runtime._adapters[poisoned].optimizer.state == {}
    for model_id in (poisoned, twin):
        train_step(runtime, model_id)
    assert_same(state_of(runtime, poisoned), state_of(runtime, twin))


def test_a_result_json_cannot_carry_fails_its_request() -> None:
    """A non-finite metric used to break retrieve_future's JSON encoding (HTTP 500, retried by the SDK
    forever); now the request fails as a server error the SDK reports."""
    fine = outcome_response(types.OptimStepResponse(metrics={"grad_norm:mean": 1.5}))
    assert types.OptimStepResponse.model_validate_json(fine.body).metrics == {"grad_norm:mean": 1.5}
    poisoned = outcome_response(types.OptimStepResponse(metrics={"grad_norm:mean": float("nan")}))
    failed = types.RequestFailedResponse.model_validate_json(poisoned.body)
    assert failed.category == types.RequestErrorCategory("server")
    assert "OptimStepResponse holds a value JSON cannot carry" in failed.error
