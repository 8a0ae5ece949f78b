"""`[N, K]` soft targets (K target tokens per position, each weighted): the engine's loss, logprobs and
gradients against a direct torch computation over the whole distribution; the wire decoding of sparse
CSR loss inputs and the encoding of `[N, K]` logprobs, read back by the tinker SDK's own converters; the
service's step-loss fallback on such datums; and the refusals (shapes, K beyond the cap)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_core_ref import hand_lora, load_plain_model, lora_leaves
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from tinker.proto.response_conv import deserialize_forward_backward_output

from tinkerrpc.contract.limits import MAX_ENGINE_SOFT_TARGETS
from tinkerrpc.contract.losses import LOSSES
from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.compute import unembedding
from tinkerrpc_server.engine.runtime import (
    LORA_ALPHA,
    BaseModelRuntime,
    DatumArrays,
    EngineUserError,
    LoraSpec,
)
from tinkerrpc_server.service.step_loss import loss_from_logprobs

pytestmark = pytest.mark.unit

RANK = 4
_ids = itertools.count()


@pytest.fixture(scope="module")
def plain_model(tiny_model_path: Path) -> torch.nn.Module:
    return load_plain_model(tiny_model_path)


def _adapter(runtime: BaseModelRuntime) -> str:
    model_id = f"soft-{next(_ids)}"
    runtime.create_adapter(model_id, LoraSpec(rank=RANK, seed=5))
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():  # B = 0 at init would leave A without a gradient
        for param in runtime.adapter_parameters(model_id).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    return model_id


def _soft_datum(rng: np.random.Generator, vocab: int, n: int, k: int | None) -> DatumArrays:
    tokens = rng.integers(0, vocab, n)
    if k is None:
        return DatumArrays(
            tokens, {"target_tokens": rng.integers(0, vocab, n), "weights": rng.random(n).astype(np.float32)}
        )
    targets = rng.integers(0, vocab, (n, k))
    targets[:, -1] = targets[:, 0]  # a repeated target: its two weights both count
    weights = rng.random((n, k)).astype(np.float32)
    weights[1] = 0.0  # a position that trains nothing
    return DatumArrays(tokens, {"target_tokens": targets, "weights": weights})


def _reference(model: torch.nn.Module, datum: DatumArrays) -> tuple[torch.Tensor, torch.Tensor]:
    """(the loss as a cross-entropy against the weights spread over the vocabulary, each position's
    log-distribution): -Σ_n Σ_v q[n, v]·log p(v | prefix n), with q[n, v] the summed weight of v's targets."""
    logits = model(input_ids=torch.tensor(datum.input_tokens).unsqueeze(0)).logits[0].float()
    log_p = torch.log_softmax(logits, dim=-1)
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"]).reshape(len(log_p), -1)
    weights = torch.tensor(datum.loss_fn_inputs["weights"]).reshape(len(log_p), -1)
    spread = torch.zeros_like(log_p).scatter_add_(-1, targets, weights)
    return -(spread * log_p).sum(), log_p


@pytest.mark.parametrize("keep_logits", [True, False])
def test_soft_target_loss_logprobs_and_gradients_match_a_direct_torch_computation(
    runtime: BaseModelRuntime,
    plain_model: torch.nn.Module,
    keep_logits: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Several chunks of positions, their logits kept for backward or computed again there.
    monkeypatch.setattr(unembedding, "CHUNK_LOGITS_BYTES", 4 * runtime.vocab_size * 3)
    if not keep_logits:
        monkeypatch.setattr(unembedding, "SAVED_LOGITS_BYTES", 4 * runtime.vocab_size)
    model_id = _adapter(runtime)
    rng = np.random.default_rng(7)
    # One micro-batch holding [N] and [N, K] datums of different K.
    data = [_soft_datum(rng, runtime.vocab_size, n, k) for n, k in ((9, 3), (8, None), (7, 5))]

    result = runtime.forward_backward(model_id, data, "cross_entropy", None, backward=True)

    leaves = lora_leaves(runtime, model_id)
    with hand_lora(plain_model, leaves, scaling=LORA_ALPHA / RANK):
        references = [_reference(plain_model, d) for d in data]
    total = torch.stack([loss for loss, _ in references]).sum()
    total.backward()
    assert result.metrics["loss:sum"] == pytest.approx(total.item(), rel=1e-4)
    for got, datum, (_, log_p) in zip(result.logprobs, data, references, strict=True):
        targets = torch.tensor(datum.loss_fn_inputs["target_tokens"])
        assert got.shape == targets.shape
        expected = log_p.gather(-1, targets.reshape(len(log_p), -1)).reshape(targets.shape)
        np.testing.assert_allclose(got, expected.detach().numpy(), atol=1e-5)
    for name, param in runtime.adapter_parameters(model_id).items():
        grad = leaves[name].grad
        assert param.grad is not None and grad is not None and grad.abs().max() > 0, name
        # float32 sums in another order: ~1e-5 apart at gradients of ~1e-2.
        torch.testing.assert_close(param.grad, grad, atol=5e-5, rtol=1e-3, msg=name)
    runtime.delete_adapter(model_id)


def test_one_soft_target_per_position_is_the_hard_target_loss(runtime: BaseModelRuntime) -> None:
    model_id = _adapter(runtime)
    hard = _soft_datum(np.random.default_rng(1), runtime.vocab_size, 6, None)
    soft = DatumArrays(hard.input_tokens, {k: v.reshape(-1, 1) for k, v in hard.loss_fn_inputs.items()})
    results = []
    for datum in (hard, soft):
        result = runtime.forward_backward(model_id, [datum], "cross_entropy", None, backward=True)
        results.append((result, {n: p.grad.clone() for n, p in runtime.adapter_parameters(model_id).items()}))
        for param in runtime.adapter_parameters(model_id).values():
            param.grad = None
    (hard_result, hard_grads), (soft_result, soft_grads) = results
    assert soft_result.logprobs[0].shape == (6, 1)
    np.testing.assert_array_equal(soft_result.logprobs[0][:, 0], hard_result.logprobs[0])
    assert soft_result.metrics["loss:sum"] == hard_result.metrics["loss:sum"]
    for name, grad in hard_grads.items():
        torch.testing.assert_close(soft_grads[name], grad, msg=name)
    runtime.delete_adapter(model_id)


def test_soft_targets_are_refused_where_they_do_not_fit_and_nothing_changes(
    runtime: BaseModelRuntime,
) -> None:
    assert [loss.name for loss in LOSSES if loss.soft_targets] == ["cross_entropy"]
    model_id = _adapter(runtime)
    n, vocab = 5, runtime.vocab_size
    tokens = np.arange(n)

    def soft(targets: np.ndarray, weights: np.ndarray) -> DatumArrays:
        return DatumArrays(tokens, {"target_tokens": targets, "weights": weights})

    ones = np.ones((n, 2), np.float32)
    grid = np.ones((n, 2), np.int64)
    too_many = MAX_ENGINE_SOFT_TARGETS + 1
    cases = [
        (soft(np.ones((n + 1, 2), np.int64), np.ones((n + 1, 2), np.float32)), "cross_entropy", "N = 5"),
        (soft(np.ones((n, too_many), np.int64), np.ones((n, too_many), np.float32)), "cross_entropy", "K in"),
        (soft(grid, np.ones(n, np.float32)), "cross_entropy", "loss_fn_inputs['weights'] has shape [5]"),
        (soft(np.full((n, 2), vocab), ones), "cross_entropy", f"token id {vocab} is outside"),
        (soft(np.ones((n, 2, 2), np.int64), np.ones((n, 2, 2), np.float32)), "cross_entropy", "give [5]"),
        (
            DatumArrays(tokens, {"target_tokens": grid, "logprobs": -ones, "advantages": ones}),
            "importance_sampling",
            "importance_sampling takes one target per position",
        ),
    ]
    before = {name: p.detach().clone() for name, p in runtime.adapter_parameters(model_id).items()}
    for datum, loss_fn, fragment in cases:
        with pytest.raises(EngineUserError, match=None) as refused:
            runtime.forward_backward(model_id, [datum], loss_fn, None, backward=True)
        assert fragment in str(refused.value), str(refused.value)
    for name, param in runtime.adapter_parameters(model_id).items():
        assert param.grad is None, name
        torch.testing.assert_close(param.detach(), before[name], rtol=0, atol=0)
    runtime.delete_adapter(model_id)


def _request(inputs: dict[str, types.TensorData], positions: int) -> pb.ForwardBackwardRequest:
    """The protobuf body the SDK sends for one datum of `positions` input tokens with these loss inputs."""
    tokens = types.ModelInput.from_ints(list(range(1, positions + 1)))
    datum = types.Datum(model_input=tokens, loss_fn_inputs=inputs)
    fwd = types.ForwardBackwardInput(data=[datum], loss_fn="cross_entropy")
    return forward_backward_request_to_proto(
        types.ForwardBackwardRequest(forward_backward_input=fwd, model_id="m", seq_id=1)
    )


def test_sparse_loss_inputs_decode_to_the_sdk_s_dense_tensor() -> None:
    # Sparse enough that the SDK sends CSR: (rows + 1) + 2·listed < rows·K.
    targets = torch.zeros((6, 8), dtype=torch.long)
    weights = torch.zeros((6, 8))
    for row, col, token, weight in (
        (0, 0, 5, 0.5),
        (1, 2, 7, 0.25),
        (1, 5, 8, 0.25),
        (3, 0, 9, 1.0),
        (3, 7, 3, 2.0),
    ):
        targets[row, col], weights[row, col] = token, weight
    inputs = {
        "target_tokens": types.TensorData.from_torch_sparse(targets),
        "weights": types.TensorData.from_torch_sparse(weights),
    }
    assert all(tensor.sparse_crow_indices is not None for tensor in inputs.values())  # sparse on the wire
    request = _request(inputs, positions=6)
    decoded = protocol.parse_forward_backward(request.SerializeToString()).data[0].loss_fn_inputs
    for name, tensor in inputs.items():
        np.testing.assert_array_equal(decoded[name], tensor.to_numpy())
    assert decoded["target_tokens"].dtype == np.int64 and decoded["weights"].dtype == np.float32


@pytest.mark.parametrize(
    ("crow", "col", "values", "shape", "fragment"),
    [
        ([0, 1, 3], [0, 1], [1, 2], [2, 3], "not a valid sparse CSR tensor"),  # ends past the columns
        ([0, 2, 2], [1, 0], [1, 2], [2, 3], "increasing within a row"),
        ([0, 1, 1], [3], [1], [2, 3], "must be in [0, 3)"),
        ([0, 1], [0], [1], [2, MAX_ENGINE_SOFT_TARGETS + 1], "K in [1,"),
        ([0, 1], [0], [1], [3, 2], "N = 2"),  # more rows than input tokens: refused before densifying
        ([0, 1], [0], [1], [3], "shape [N, K]"),
    ],
)
def test_bad_sparse_loss_inputs_are_a_problem_naming_the_field(
    crow: list[int], col: list[int], values: list[int], shape: list[int], fragment: str
) -> None:
    tensor = pb.Tensor(dtype=pb.DTYPE_INT64, shape=shape)
    tensor.sparse_csr.values = np.asarray(values, np.int64).tobytes()
    tensor.sparse_csr.crow_indices = np.asarray(crow, np.int64).tobytes()
    tensor.sparse_csr.col_indices = np.asarray(col, np.int64).tobytes()
    request = _request({}, positions=2)
    request.data[0].loss_fn_inputs["target_tokens"].CopyFrom(tensor)
    # Not raised: the request fails in its model's turn, so later requests do not wait for its seq_id.
    call = protocol.parse_forward_backward(request.SerializeToString())
    assert (call.model_id, call.seq_id, call.data) == ("m", 1, [])
    assert call.problem is not None and "loss_fn_inputs['target_tokens']" in call.problem
    assert fragment in call.problem, call.problem


def test_soft_target_logprobs_come_back_to_the_sdk_in_their_datums_shapes() -> None:
    rng = np.random.default_rng(0)
    shapes = [(4, 3), (2, 3), (5,), (3, 2), (1,)]
    logprobs = [-rng.random(shape).astype(np.float32) for shape in shapes]
    encoded = protocol.encode_forward_result(protocol.ForwardResult(logprobs, {"loss:sum": 1.5}))
    output = deserialize_forward_backward_output(encoded)
    assert output.metrics == {"loss:sum": 1.5}
    assert len(output.loss_fn_outputs) == len(shapes)
    for got, want in zip(output.loss_fn_outputs, logprobs, strict=True):
        assert got["logprobs"].shape == list(want.shape)
        np.testing.assert_array_equal(got["logprobs"].to_numpy(), want)


def test_the_step_loss_fallback_sums_soft_targets_like_the_engine() -> None:
    rng = np.random.default_rng(4)
    weights = rng.random((8, 10)).astype(np.float32) * (rng.random((8, 10)) < 0.2)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(list(range(8))),
        loss_fn_inputs={
            "target_tokens": torch.tensor(rng.integers(1, 50, (8, 10))),
            "weights": torch.tensor(weights),
        },
    )
    assert datum.loss_fn_inputs["weights"].sparse_crow_indices is not None  # the SDK sparsified it
    lp = -rng.random((8, 10)).astype(np.float32)
    outputs = [{"logprobs": types.TensorData.from_numpy(lp)}]
    loss = loss_from_logprobs("cross_entropy", None, [datum], outputs)
    assert loss == pytest.approx(float(-(lp.astype(np.float64) * weights).sum()), rel=1e-6)
