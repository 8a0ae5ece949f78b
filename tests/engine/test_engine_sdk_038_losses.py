"""Tinker 0.38's training additions through the unmodified SDK against a real engine: `[N, K]` soft
targets (a teacher's top-K, as off-policy distillation sends them), dense and sparse, in forward,
forward_backward and forward_backward_custom; the Dimuon optimizer (its steps, its family fixed at
creation, its state through checkpoints); and their refusals, which leave the client usable."""

from __future__ import annotations

import itertools
import json

import numpy as np
import pytest
import tinker
import torch
from engine_proc import TINY, seq_gaps
from safetensors.torch import load_file
from tinker import types
from tinker.types.optimizer import OptimizerConfigBase

from tinkerrpc.contract.limits import MAX_ENGINE_SOFT_TARGETS
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

ADAM = types.AdamParams(learning_rate=5e-3)
SEQUENCE = [11, 42, 17, 99, 23, 5, 8, 61, 7, 30]
K = 4


def teacher_top_k(service: tinker.ServiceClient) -> tuple[np.ndarray, np.ndarray]:
    """The base model's top-K (ids, logprobs) at each position of SEQUENCE after the first: position n's
    row is the distribution of the token after SEQUENCE[: n + 1]."""
    teacher = service.create_sampling_client(base_model=TINY).result()
    scored = teacher.sample(
        types.ModelInput.from_ints(SEQUENCE), 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=K
    ).result()
    top = scored.topk_prompt_logprobs_np
    assert top is not None
    return top.token_ids[1:].astype(np.int64), top.logprobs[1:]


def soft_datum(ids: np.ndarray, weights: np.ndarray, *, sparse: bool) -> types.Datum:
    """A datum predicting SEQUENCE[1:] from SEQUENCE[:-1] with [N, K] targets; sparse through the SDK's
    own CSR encoding (TensorData.from_torch_sparse: cells equal to 0 are left out)."""
    if sparse:
        targets = types.TensorData.from_torch_sparse(torch.from_numpy(ids))
        weighting = types.TensorData.from_torch_sparse(torch.from_numpy(weights))
        assert targets.sparse_crow_indices is not None and weighting.sparse_crow_indices is not None
    else:
        targets, weighting = types.TensorData.from_numpy(ids), types.TensorData.from_numpy(weights)
    return types.Datum(
        model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={"target_tokens": targets, "weights": weighting},
    )


def distillation_grid(ids: np.ndarray, logprobs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The cookbook's soft targets: the top-K renormalised to weights, here on the last two positions
    only (the rest masked to id 0 and weight 0, which the sparse encoding leaves out)."""
    weights = np.exp(logprobs - np.logaddexp.reduce(logprobs, axis=-1, keepdims=True)).astype(np.float32)
    trained = np.zeros(len(ids), dtype=bool)
    trained[-2:] = True
    return np.where(trained[:, None], ids, 0), np.where(trained[:, None], weights, 0.0).astype(np.float32)


def logprobs_of(output: types.ForwardBackwardOutput) -> np.ndarray:
    (only,) = output.loss_fn_outputs
    return only["logprobs"].to_numpy()


def test_soft_targets_dense_and_sparse_score_and_train_a_teacher_s_top_k(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    ids, teacher_logprobs = teacher_top_k(service)
    n = len(SEQUENCE) - 1
    assert ids.shape == (n, K)
    student = service.create_lora_training_client(TINY, rank=4, seed=9).result()

    # The student is the base model until it trains (LoRA B = 0): its logprobs of the teacher's top-K
    # are the teacher's, each column the one a [N] target of the same ids gets.
    dense = student.forward([soft_datum(ids, np.ones((n, K), np.float32), sparse=False)], "cross_entropy")
    scored = logprobs_of(dense.result())
    assert scored.shape == (n, K)
    np.testing.assert_allclose(scored, teacher_logprobs, atol=1e-4)
    for column in range(K):
        hard = types.Datum(
            model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
            loss_fn_inputs={"target_tokens": ids[:, column], "weights": np.ones(n, np.float32)},
        )
        np.testing.assert_allclose(
            logprobs_of(student.forward([hard], "cross_entropy").result()), scored[:, column], atol=1e-6
        )

    masked_ids, weights = distillation_grid(ids, teacher_logprobs)
    outputs = {
        sparse: student.forward([soft_datum(masked_ids, weights, sparse=sparse)], "cross_entropy").result()
        for sparse in (False, True)
    }
    np.testing.assert_array_equal(logprobs_of(outputs[True]), logprobs_of(outputs[False]))
    loss = outputs[True].metrics["loss:sum"]
    assert loss == outputs[False].metrics["loss:sum"]
    assert loss == pytest.approx(float(-(weights * logprobs_of(outputs[True])).sum()), rel=1e-5)

    # Training on the sparse grid lowers its cross-entropy, step after step.
    losses = [loss]
    for _ in range(3):
        step = student.forward_backward([soft_datum(masked_ids, weights, sparse=True)], "cross_entropy")
        student.optim_step(ADAM).result()
        assert step.result().metrics["loss:sum"] == pytest.approx(losses[-1], rel=1e-5)
        after = student.forward([soft_datum(masked_ids, weights, sparse=True)], "cross_entropy").result()
        losses.append(after.metrics["loss:sum"])
    assert all(later < earlier for earlier, later in itertools.pairwise(losses)), losses
    assert seq_gaps(engine, student.model_id) == []


def test_a_custom_loss_over_a_target_distribution_gets_and_trains_n_by_k_logprobs(
    service: tinker.ServiceClient,
) -> None:
    """The SDK's own forward_backward_custom example: `target_tokens` [[2, 3]] with a 0.25/0.75 target
    distribution, the loss -Σ q·logprobs."""
    client = service.create_lora_training_client(TINY, rank=4, seed=2).result()
    distribution = types.TensorData(data=[0.25, 0.75], dtype="float32", shape=[1, 2])
    data = [
        types.Datum(
            model_input=types.ModelInput.from_ints([1]),
            loss_fn_inputs={"target_tokens": [[2, 3]], "target_distribution": distribution},
        )
    ]
    seen: list[tuple[int, ...]] = []

    def custom_loss(
        data: list[types.Datum], logprobs_list: list[torch.Tensor]
    ) -> tuple[torch.Tensor, dict[str, float]]:
        seen.extend(tuple(lp.shape) for lp in logprobs_list)
        loss = sum(
            -(datum.loss_fn_inputs["target_distribution"].to_torch() * logprobs).sum()
            for datum, logprobs in zip(data, logprobs_list, strict=True)
        )
        return loss, {}  # type: ignore[return-value]

    before = client.forward_backward_custom(data, custom_loss).result().metrics["loss:sum"]
    client.optim_step(ADAM).result()
    after = client.forward_backward_custom(data, custom_loss).result().metrics["loss:sum"]
    assert seen == [(1, 2), (1, 2)]
    assert after < before


def expect_failure(call: object, *fragments: str) -> None:
    with pytest.raises(tinker.RequestFailedError) as info:
        call.result()  # type: ignore[attr-defined]
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


def test_bad_soft_targets_fail_in_turn_naming_the_problem_and_the_client_goes_on(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = service.create_lora_training_client(TINY, rank=4, seed=4).result()
    n = len(SEQUENCE) - 1
    prompt = types.ModelInput.from_ints(SEQUENCE[:-1])

    def grid(k: int, rows: int = n) -> dict[str, types.TensorData]:
        return {
            "target_tokens": types.TensorData.from_numpy(np.ones((rows, k), np.int64)),
            "weights": types.TensorData.from_numpy(np.ones((rows, k), np.float32)),
        }

    too_wide = grid(MAX_ENGINE_SOFT_TARGETS + 1)
    expect_failure(
        client.forward_backward([types.Datum(model_input=prompt, loss_fn_inputs=too_wide)], "cross_entropy"),
        "target_tokens",
        str(MAX_ENGINE_SOFT_TARGETS),
    )
    expect_failure(
        client.forward_backward(
            [types.Datum(model_input=prompt, loss_fn_inputs=grid(2, n + 1))], "cross_entropy"
        ),
        "target_tokens",
        f"N = {n}",
    )
    rl = {
        "target_tokens": np.ones((n, 2), np.int64),
        "logprobs": np.full((n, 2), -1.0, np.float32),
        "advantages": np.ones((n, 2), np.float32),
    }
    expect_failure(
        client.forward_backward([types.Datum(model_input=prompt, loss_fn_inputs=rl)], "ppo"),
        "ppo takes one target per position",
    )
    # A sparse grid whose column indices fall outside its K: read on arrival, failed in its turn.
    broken = types.TensorData(
        data=[5],
        dtype="int64",
        shape=[n, 2],
        sparse_crow_indices=[0, 1] + [1] * (n - 1),
        sparse_col_indices=[2],
    )
    weights = types.TensorData.from_numpy(np.ones((n, 2), np.float32))
    expect_failure(
        client.forward_backward(
            [types.Datum(model_input=prompt, loss_fn_inputs={"target_tokens": broken, "weights": weights})],
            "cross_entropy",
        ),
        "loss_fn_inputs['target_tokens']",
        "[0, 2)",
    )
    # Nothing above trained: a step now has no gradients (decay only, which is 0), and the client goes on.
    probe = [types.Datum(model_input=prompt, loss_fn_inputs=grid(2))]
    before = logprobs_of(client.forward(probe, "cross_entropy").result())
    client.optim_step(ADAM).result()
    np.testing.assert_array_equal(logprobs_of(client.forward(probe, "cross_entropy").result()), before)
    client.forward_backward(probe, "cross_entropy").result()
    client.optim_step(ADAM).result()
    assert not np.allclose(logprobs_of(client.forward(probe, "cross_entropy").result()), before)
    assert seq_gaps(engine, client.model_id) == []


# ---- the Dimuon optimizer ----

BATCH = [
    types.Datum(
        model_input=types.ModelInput.from_ints(SEQUENCE[:-1]),
        loss_fn_inputs={"target_tokens": np.asarray(SEQUENCE[1:]), "weights": np.ones(len(SEQUENCE) - 1)},
    )
]
DIMUON_RANK = 4


def saved(engine: LocalEngine, model_id: str, name: str) -> tuple[dict[str, torch.Tensor], dict[str, object]]:
    """A save_state checkpoint's LoRA weights and LoRA spec (with its optimizer family), as the engine
    wrote them."""
    directory = engine.data_dir / "runs" / model_id / "weights" / name
    spec = json.loads((directory / "tinkerrpc_lora.json").read_text())
    return load_file(str(directory / "adapter_model.safetensors")), spec


def test_a_dimuon_client_steps_along_the_momentum_s_matrix_sign_and_refuses_adam_steps(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = service.create_lora_training_client(
        TINY, rank=DIMUON_RANK, seed=3, optimizer=types.DimuonOptimizerConfig()
    ).result()
    client.save_state("before").result()
    client.forward_backward(BATCH, "cross_entropy").result()
    # An Adam step on a Dimuon model fails in its turn, changes nothing, and the client goes on.
    expect_failure(client.optim_step(ADAM), "optim_params: type 'adamw'", "optimizer 'dimuon'")
    lr = 0.05
    metrics = client.optim_step(types.DimuonParams(learning_rate=lr, beta1=0.9)).result().metrics
    assert metrics is not None and metrics["learning_rate:mean"] == lr
    client.save_state("after").result()

    before, _ = saved(engine, client.model_id, "before")
    after, spec = saved(engine, client.model_id, "after")
    assert spec["optimizer"] == "dimuon"
    moved = 0
    for name, weight in after.items():
        delta = (weight - before[name]).double()
        if "lora_A" in name:  # B = 0 before the first step: A had no gradient, so no momentum
            assert torch.count_nonzero(delta) == 0, name
            continue
        # The first step moves B by lr along msign(G): Frobenius norm lr·sqrt(rank), singular values equal.
        singular = torch.linalg.svdvals(delta)
        assert float(torch.linalg.matrix_norm(delta)) == pytest.approx(lr * DIMUON_RANK**0.5, rel=1e-4), name
        torch.testing.assert_close(singular, torch.full_like(singular, lr), rtol=1e-3, atol=0)
        moved += 1
    assert moved > 0
    assert seq_gaps(engine, client.model_id) == []


def test_dimuon_state_resumes_through_the_sdk_and_keeps_its_family(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    dimuon = types.DimuonParams(learning_rate=0.02, beta1=0.8)
    straight = service.create_lora_training_client(
        TINY, rank=DIMUON_RANK, seed=5, optimizer=types.DimuonOptimizerConfig()
    ).result()
    for _ in range(2):
        straight.forward_backward(BATCH, "cross_entropy").result()
        straight.optim_step(dimuon).result()
    state = straight.save_state("two-steps").result().path
    rest = engine.rest_client()
    # weights_info names the run's optimizer (the SDK reads a Dimuon config as its OptimizerConfigBase).
    dimuon_info = rest.get_weights_info_by_tinker_path(state).result().optimizer_config
    assert (dimuon_info.type, dimuon_info.model_dump().get("version")) == ("dimuon", 1)
    adam_client = service.create_lora_training_client(TINY, rank=4, seed=5).result()
    adam_state = adam_client.save_weights_for_sampler("adam").result().path
    assert rest.get_weights_info_by_tinker_path(adam_state).result().optimizer_config.type == "adamw"

    resumed = service.create_training_client_from_state_with_optimizer(state).result()
    # A Dimuon version this engine does not run is refused at creation (the SDK's type allows only 1).
    other_version = OptimizerConfigBase(type="dimuon", version=2)
    with pytest.raises(tinker.BadRequestError, match="Dimuon version 2"):
        service.create_lora_training_client(TINY, rank=4, optimizer=other_version).result()
    for client in (straight, resumed):
        client.forward_backward(BATCH, "cross_entropy").result()
        client.optim_step(dimuon).result()
    expect_failure(resumed.optim_step(ADAM), "optimizer 'dimuon'")
    probe = BATCH
    np.testing.assert_allclose(
        logprobs_of(resumed.forward(probe, "cross_entropy").result()),
        logprobs_of(straight.forward(probe, "cross_entropy").result()),
        atol=1e-6,
    )
    # Weights only: a fresh optimizer of the family asked for (the SDK's default, AdamW, when none is).
    as_adam = service.create_training_client_from_state(state).result()
    expect_failure(as_adam.optim_step(dimuon), "optimizer 'adamw'")
    as_dimuon = service.create_training_client_from_state(
        state, optimizer=types.DimuonOptimizerConfig()
    ).result()
    as_dimuon.forward_backward(BATCH, "cross_entropy").result()
    as_dimuon.optim_step(dimuon).result()
