"""The Dimuon optimizer (compute/optimizer_families.py) against an independent numpy reference: the
matrix sign, the direction's Frobenius norm sqrt(rank), the EMA momentum over steps; a model's family
fixed at creation (another family's step refused, changing nothing); its momentum through save/load."""

from __future__ import annotations

import itertools
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from tinkerrpc_server.engine.compute.optimizer_families import ADAMW, DIMUON, dimuon_direction, matrix_sign
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, EngineUserError, LoraSpec

pytestmark = pytest.mark.unit

ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
RANK = 4
_ids = itertools.count()


def reference_sign(matrix: np.ndarray) -> np.ndarray:
    """U·Vᵀ over the singular values that are not ~0."""
    u, s, vh = np.linalg.svd(matrix.astype(np.float64), full_matrices=False)
    kept = s > s.max() * 1e-6
    return np.asarray(u[:, kept] @ vh[kept])


def test_matrix_sign_is_the_polar_factor_and_the_direction_has_norm_sqrt_rank() -> None:
    generator = torch.Generator().manual_seed(0)
    for shape in ((4, 64), (96, 4), (8, 8)):
        momentum = torch.randn(shape, generator=generator)
        sign = matrix_sign(momentum)
        np.testing.assert_allclose(sign.numpy(), reference_sign(momentum.numpy()), atol=1e-5)
        small = min(shape)
        gram = sign @ sign.T if shape[0] == small else sign.T @ sign
        torch.testing.assert_close(gram, torch.eye(small), atol=1e-5, rtol=0)
        direction = dimuon_direction(momentum)
        assert float(torch.linalg.matrix_norm(direction)) == pytest.approx(math.sqrt(small), rel=1e-5)
    # Rank 1 (B's momentum of a fresh LoRA pair, say): the sign has one direction, rescaled to sqrt(rank).
    rank_one = torch.outer(torch.randn(32, generator=generator), torch.randn(RANK, generator=generator))
    assert float(torch.linalg.matrix_norm(matrix_sign(rank_one))) == pytest.approx(1.0, rel=1e-5)
    assert float(torch.linalg.matrix_norm(dimuon_direction(rank_one))) == pytest.approx(
        math.sqrt(RANK), rel=1e-5
    )
    assert torch.count_nonzero(dimuon_direction(torch.zeros(RANK, 16))) == 0


def _adapter(runtime: BaseModelRuntime, family: str) -> str:
    model_id = f"dimuon-{next(_ids)}"
    runtime.create_adapter(model_id, LoraSpec(rank=RANK, seed=11, optimizer=family))
    return model_id


def _batch(runtime: BaseModelRuntime, seed: int) -> list[DatumArrays]:
    rng = np.random.default_rng(seed)
    data = []
    for n in (7, 5):
        tokens = rng.integers(0, runtime.vocab_size, n + 1)
        data.append(
            DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(n, np.float32)})
        )
    return data


def _values(runtime: BaseModelRuntime, model_id: str) -> dict[str, np.ndarray]:
    return {name: p.detach().numpy().copy() for name, p in runtime.adapter_parameters(model_id).items()}


def test_dimuon_steps_follow_the_ema_momentum_s_matrix_sign(runtime: BaseModelRuntime) -> None:
    model_id = _adapter(runtime, DIMUON)
    lr, beta1 = 0.02, 0.8
    momentum: dict[str, np.ndarray] = {}
    for step in range(3):
        runtime.forward_backward(model_id, _batch(runtime, step), "cross_entropy", None, backward=True)
        grads = {n: p.grad.numpy().copy() for n, p in runtime.adapter_parameters(model_id).items()}
        before = _values(runtime, model_id)
        metrics = runtime.dimuon_step(model_id, learning_rate=lr, beta1=beta1, grad_clip_norm=0.0)
        assert metrics["learning_rate:mean"] == lr
        after = _values(runtime, model_id)
        moved = 0
        for name, grad in grads.items():
            momentum[name] = beta1 * momentum.get(name, 0.0) + (1 - beta1) * grad.astype(np.float64)
            if not momentum[name].any():  # LoRA A on the first step: B = 0 gives it no gradient
                np.testing.assert_array_equal(after[name], before[name])
                continue
            sign = reference_sign(momentum[name])
            expected = before[name] - lr * math.sqrt(RANK) * sign / np.linalg.norm(sign)
            np.testing.assert_allclose(after[name], expected, atol=1e-6, err_msg=name)
            moved += 1
        assert moved >= len(grads) // 2
    runtime.delete_adapter(model_id)


def test_a_model_s_family_is_fixed_and_another_family_s_step_changes_nothing(
    runtime: BaseModelRuntime,
) -> None:
    for family, wrong_step, fragment in (
        (DIMUON, lambda m: runtime.optim_step(m, **ADAM), "type 'adamw' (AdamParams) does not match"),
        (
            ADAMW,
            lambda m: runtime.dimuon_step(m, 0.1, 0.9, 0.0),
            "type 'dimuon' (DimuonParams) does not match",
        ),
    ):
        model_id = _adapter(runtime, family)
        runtime.forward_backward(model_id, _batch(runtime, 0), "cross_entropy", None, backward=True)
        before = _values(runtime, model_id)
        with pytest.raises(EngineUserError, match=None) as refused:
            wrong_step(model_id)
        assert fragment in str(refused.value) and f"optimizer {family!r}" in str(refused.value)
        for name, value in _values(runtime, model_id).items():
            np.testing.assert_array_equal(value, before[name])
        assert all(p.grad is not None for p in runtime.adapter_parameters(model_id).values())
        runtime.delete_adapter(model_id)
    model_id = _adapter(runtime, DIMUON)
    for bad in ({"learning_rate": -1.0}, {"beta1": 1.0}, {"learning_rate": math.nan}):
        with pytest.raises(EngineUserError, match="invalid DimuonParams"):
            runtime.dimuon_step(
                model_id, **{"learning_rate": 0.1, "beta1": 0.9, "grad_clip_norm": 0.0, **bad}
            )
    runtime.delete_adapter(model_id)


def test_dimuon_momentum_saves_and_resumes_like_an_uninterrupted_run(
    runtime: BaseModelRuntime, tmp_path: Path
) -> None:
    straight, interrupted = _adapter(runtime, DIMUON), _adapter(runtime, DIMUON)
    for step in range(2):
        for model_id in (straight, interrupted):
            runtime.forward_backward(model_id, _batch(runtime, step), "cross_entropy", None, backward=True)
            runtime.dimuon_step(model_id, learning_rate=0.02, beta1=0.9, grad_clip_norm=0.0)
    runtime.save_state(interrupted, tmp_path / "state", include_optimizer=True)
    runtime.delete_adapter(interrupted)
    with pytest.raises(EngineUserError, match="is 'dimuon'; it cannot be loaded as 'adamw'"):
        runtime.load_state("resumed", tmp_path / "state", include_optimizer=True, optimizer=ADAMW)
    spec = runtime.load_state("resumed", tmp_path / "state", include_optimizer=True)
    assert spec.optimizer == DIMUON
    fresh = runtime.load_state("weights-only", tmp_path / "state", include_optimizer=False)
    assert fresh.optimizer == ADAMW  # the SDK's default for a weights-only load
    # A load into a live model keeps its family: state of another family, or another family asked for, is refused.
    with pytest.raises(EngineUserError, match="it cannot be loaded as 'adamw'"):
        runtime.load_state("weights-only", tmp_path / "state", include_optimizer=True)
    with pytest.raises(EngineUserError, match="trains with 'adamw'; a load keeps it"):
        runtime.load_state("weights-only", tmp_path / "state", include_optimizer=False, optimizer=DIMUON)
    assert runtime.load_state("weights-only", tmp_path / "state", include_optimizer=False).optimizer == ADAMW
    for model_id in (straight, "resumed"):
        runtime.forward_backward(model_id, _batch(runtime, 5), "cross_entropy", None, backward=True)
        runtime.dimuon_step(model_id, learning_rate=0.02, beta1=0.9, grad_clip_norm=0.0)
    for name, value in _values(runtime, straight).items():
        np.testing.assert_allclose(_values(runtime, "resumed")[name], value, atol=1e-6, err_msg=name)
    for model_id in (straight, "resumed", "weights-only"):
        runtime.delete_adapter(model_id)
