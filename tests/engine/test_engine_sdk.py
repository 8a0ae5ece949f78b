"""The unmodified tinker SDK against a real engine process: training, state, sampling, scheduling, errors."""

from __future__ import annotations

import concurrent.futures
from pathlib import Path

import httpx
import numpy as np
import pytest
import tinker
import torch
from engine_proc import TINY, seq_gaps
from peft import PeftModel
from tinker import types
from tinker.proto import tinker_public_pb2 as pb
from tinker.proto.request_conv import forward_backward_request_to_proto
from transformers import AutoModelForCausalLM

from bench.sdk_probe_core import BATCH, FINGERPRINT, datum, fingerprint, train_step
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process


def new_model(service: tinker.ServiceClient, seed: int = 3) -> tinker.TrainingClient:
    return service.create_lora_training_client(TINY, rank=4, seed=seed).result()


def test_train_save_sample_and_resume_with_optimizer(service: tinker.ServiceClient) -> None:
    client = new_model(service)
    before = fingerprint(client)
    first_loss = train_step(client)
    assert not np.allclose(fingerprint(client), before), "an optimizer step must change the weights"
    state_path = client.save_state("after-1").result().path
    assert state_path == f"tinker://{client.model_id}/weights/after-1"
    sampler_path = client.save_weights_for_sampler("after-1").result().path
    assert sampler_path == f"tinker://{client.model_id}/sampler_weights/after-1"

    second_loss = train_step(client)
    assert second_loss < first_loss
    uninterrupted = fingerprint(client)

    resumed = service.create_training_client_from_state_with_optimizer(state_path).result()
    assert resumed.model_id != client.model_id
    assert train_step(resumed) == pytest.approx(second_loss, abs=1e-5)
    np.testing.assert_allclose(fingerprint(resumed), uninterrupted, atol=1e-6)

    # Weights only (fresh Adam state): same starting point, a different step.
    fresh = service.create_training_client_from_state(state_path).result()
    train_step(fresh)
    assert not np.allclose(fingerprint(fresh), uninterrupted, atol=1e-6)

    # Sampling from the sampler checkpoint scores the prompt with the saved weights.
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    prompt = [*FINGERPRINT[0].model_input.to_ints(), 37]
    scored = sampler.compute_logprobs(types.ModelInput.from_ints(prompt)).result()
    assert scored[0] is None and len(scored) == len(prompt)
    at_save = resumed_at_state(service, state_path)
    np.testing.assert_allclose(np.asarray(scored[1:], dtype=np.float32), at_save, atol=1e-4)

    live = client.save_weights_and_get_sampling_client().result()
    response = live.sample(
        types.ModelInput.from_ints([5, 6, 7]), 3, types.SamplingParams(max_tokens=4)
    ).result()
    assert len(response.sequences) == 3
    assert all(len(s.tokens) == len(s.logprobs or []) <= 4 for s in response.sequences)


def resumed_at_state(service: tinker.ServiceClient, state_path: str) -> np.ndarray:
    return fingerprint(service.create_training_client_from_state(state_path).result())


def torch_reference_logprobs(
    model_dir: Path, adapter_dir: Path, data: list[types.Datum]
) -> list[torch.Tensor]:
    base = AutoModelForCausalLM.from_pretrained(model_dir / TINY, dtype=torch.float32)
    model = PeftModel.from_pretrained(base, str(adapter_dir)).eval()
    result = []
    with torch.no_grad():
        for d in data:
            tokens = torch.tensor([d.model_input.to_ints()])
            logits = model(input_ids=tokens).logits[0].float()
            targets = torch.as_tensor(d.loss_fn_inputs["target_tokens"].to_numpy())
            result.append(torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0])
    return result


def test_losses_match_plain_torch(service: tinker.ServiceClient, engine: LocalEngine) -> None:
    client = new_model(service, seed=11)
    train_step(client)  # move away from the zero-initialised LoRA so the adapter matters
    path = client.save_weights_for_sampler("reference").result().path
    adapter_dir = engine.data_dir / "runs" / client.model_id / "sampler_weights" / "reference"
    assert (adapter_dir / "adapter_model.safetensors").is_file(), path
    reference = torch_reference_logprobs(engine.model_dir, adapter_dir, BATCH)

    ce = client.forward(BATCH, "cross_entropy").result()
    for out, ref in zip(ce.loss_fn_outputs, reference, strict=True):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref.numpy(), atol=1e-4)
    weights = [torch.as_tensor(d.loss_fn_inputs["weights"].to_numpy()) for d in BATCH]
    expected_ce = -sum(float((lp * w).sum()) for lp, w in zip(reference, weights, strict=True))
    assert ce.metrics["loss:sum"] == pytest.approx(expected_ce, rel=1e-4)

    rng = np.random.default_rng(0)
    ppo_data, expected_ppo = [], 0.0
    for d, lp in zip(BATCH, reference, strict=True):
        n = len(lp)
        # Sampler logprobs off by up to ±0.5 so that both clip sides are hit.
        sampled = lp.numpy() + rng.uniform(-0.5, 0.5, n).astype(np.float32)
        advantages = rng.normal(size=n).astype(np.float32)
        ppo_data.append(
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "logprobs": sampled,
                    "advantages": advantages,
                },
            )
        )
        ratio = torch.exp(lp - torch.as_tensor(sampled))
        adv = torch.as_tensor(advantages)
        expected_ppo += -float(torch.minimum(ratio * adv, ratio.clamp(0.8, 1.2) * adv).sum())
    ppo = client.forward(ppo_data, "ppo").result()
    assert ppo.metrics["loss:sum"] == pytest.approx(expected_ppo, rel=1e-4, abs=1e-5)
    for out, ref in zip(ppo.loss_fn_outputs, reference, strict=True):
        np.testing.assert_allclose(out["logprobs"].to_numpy(), ref.numpy(), atol=1e-4)


def test_sampling_seed_and_stops(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = types.ModelInput.from_ints([3, 14, 15, 92])

    def sample(**params: object) -> list[list[int]]:
        response = sampler.sample(prompt, 2, types.SamplingParams(**params)).result()  # type: ignore[arg-type]
        return [list(s.tokens) for s in response.sequences]

    same = sample(max_tokens=12, seed=7, stop=[])
    assert same == sample(max_tokens=12, seed=7, stop=[])
    assert all(len(s) == 12 for s in same), "stop=[] disables EOS: every sample runs to max_tokens"
    assert same != sample(max_tokens=12, seed=8, stop=[])

    stop_token = same[0][4]
    stopped = sampler.sample(
        prompt, 1, types.SamplingParams(max_tokens=12, seed=7, stop=[stop_token])
    ).result()
    seq = stopped.sequences[0]
    assert seq.stop_reason == "stop"
    assert list(seq.tokens) == same[0][: same[0].index(stop_token) + 1]

    long = (
        sampler.sample(prompt, 1, types.SamplingParams(max_tokens=12, seed=7, stop=[])).result().sequences[0]
    )
    assert long.stop_reason == "length"


def test_concurrent_samples_are_batched(service: tinker.ServiceClient, engine: LocalEngine) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    before = engine.stats()
    futures = [
        sampler.sample(
            types.ModelInput.from_ints([20 + i, 21, 22]), 2, types.SamplingParams(max_tokens=16, seed=i)
        )
        for i in range(8)
    ]
    results = [f.result() for f in futures]
    after = engine.stats()
    assert all(len(r.sequences) == 2 for r in results)
    requests = after["sample_requests"] - before["sample_requests"]
    batches = after["sample_batches"] - before["sample_batches"]
    assert requests == 8
    assert batches < requests, f"8 concurrent requests ran in {batches} batches"
    assert after["largest_sample_batch"] >= 2


def _post_proto(engine: LocalEngine, request: types.ForwardBackwardRequest) -> str:
    body = forward_backward_request_to_proto(request).SerializeToString()
    response = httpx.post(
        f"{engine.base_url}/api/v1/forward_backward",
        content=body,
        headers={"Content-Type": "application/x-protobuf", **engine.auth_headers},
    )
    response.raise_for_status()
    return str(response.json()["request_id"])


def _retrieve(engine: LocalEngine, request_id: str) -> httpx.Response:
    response = httpx.post(
        f"{engine.base_url}/api/v1/retrieve_future",
        json={"request_id": request_id},
        headers=engine.auth_headers,
        timeout=60,
    )
    response.raise_for_status()
    return response


def test_operations_run_in_seq_order_even_when_they_arrive_out_of_order(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = new_model(service, seed=5)
    initial = fingerprint(client)  # seq 1
    # seq 3 (optim_step) arrives before seq 2 (forward): the engine must still run the forward first.
    optim = httpx.post(
        f"{engine.base_url}/api/v1/optim_step",
        json={"model_id": client.model_id, "seq_id": 3, "adam_params": {"learning_rate": 0.05}},
        headers=engine.auth_headers,
    ).json()["request_id"]
    fwd_request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=FINGERPRINT + BATCH, loss_fn="cross_entropy"),
        model_id=client.model_id,
        seq_id=2,
    )
    fwd = _post_proto(engine, fwd_request)
    assert "metrics" in _retrieve(engine, optim).json()
    output = pb.ForwardBackwardOutput.FromString(_retrieve(engine, fwd).content)
    offsets = np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].offsets, dtype=np.int64)
    values = np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].data, dtype=np.float32)
    # The forward saw the weights from before the step; the step ran after it.
    np.testing.assert_allclose(values[: offsets[1] // 4], initial, atol=1e-6)
    assert not np.allclose(probe_logprobs_raw(engine, client.model_id, seq_id=4), initial)


def test_a_resent_request_is_answered_by_the_first_and_runs_once(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    """The SDK resends a request whose answer it missed (a timeout, a 5xx) with the same body."""
    client = new_model(service, seed=9)
    fingerprint(client)  # seq 1
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=FINGERPRINT + BATCH, loss_fn="cross_entropy"),
        model_id=client.model_id,
        seq_id=2,
    )
    ops_before = engine.stats()["training_ops"]
    first = _post_proto(engine, request)
    assert _post_proto(engine, request) == first
    assert pb.ForwardBackwardOutput.FromString(_retrieve(engine, first).content).loss_fn_outputs
    assert engine.stats()["training_ops"] == ops_before + 1
    # Another operation under a used seq_id is still refused.
    optim = httpx.post(
        f"{engine.base_url}/api/v1/optim_step",
        json={"model_id": client.model_id, "seq_id": 2, "adam_params": {"learning_rate": 0.05}},
        headers=engine.auth_headers,
    ).json()["request_id"]
    assert "seq_id 2 was already used" in _retrieve(engine, optim).text


def test_malformed_bodies_fail_clearly_and_keep_the_seq_order(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = new_model(service, seed=7)
    initial = fingerprint(client)  # seq 1
    # JSON has no NaN: the SDK sends a NaN learning rate as null, which AdamParams refuses.
    rejected = httpx.post(
        f"{engine.base_url}/api/v1/optim_step",
        json={"model_id": client.model_id, "seq_id": 2, "adam_params": {"learning_rate": None}},
        headers=engine.auth_headers,
    )
    assert rejected.status_code == 200, rejected.text
    failure = _retrieve(engine, rejected.json()["request_id"]).json()
    assert failure["category"] == "user" and "adam_params" in failure["error"]
    # The rejected request took its turn: seq 3 runs at once, on unchanged weights.
    np.testing.assert_allclose(probe_logprobs_raw(engine, client.model_id, seq_id=3), initial, atol=1e-6)
    assert seq_gaps(engine, client.model_id) == [], (
        "a rejected request must not leave a gap in the seq_id order"
    )
    # What a gap looks like: seq 4 never comes, so seq 5 runs once the gap timeout has passed.
    np.testing.assert_allclose(probe_logprobs_raw(engine, client.model_id, seq_id=5), initial, atol=1e-6)
    (gap,) = seq_gaps(engine, client.model_id)
    assert gap.endswith(f"model {client.model_id}: seq 4 never arrived, running seq 5")

    # Outside a model's numbered sequence, a malformed body is a 400 that names the field.
    response = httpx.post(
        f"{engine.base_url}/api/v1/create_sampling_session",
        json={"sampling_session_seq_id": 0, "base_model": TINY},
        headers=engine.auth_headers,
    )
    assert response.status_code == 400 and "session_id" in response.json()["detail"]


def probe_logprobs_raw(engine: LocalEngine, model_id: str, seq_id: int) -> np.ndarray:
    request = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=FINGERPRINT, loss_fn="cross_entropy"),
        model_id=model_id,
        seq_id=seq_id,
    )
    proto = forward_backward_request_to_proto(request)
    proto.forward_only = True
    response = httpx.post(
        f"{engine.base_url}/api/v1/forward_backward",
        content=proto.SerializeToString(),
        headers={"Content-Type": "application/x-protobuf", **engine.auth_headers},
    )
    output = pb.ForwardBackwardOutput.FromString(_retrieve(engine, response.json()["request_id"]).content)
    return np.frombuffer(output.loss_fn_outputs[0].fields["logprobs"].data, dtype=np.float32)


def test_bad_inputs_fail_clearly_and_change_nothing(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = new_model(service, seed=21)
    untouched = new_model(service, seed=21)
    train_step(client)
    train_step(untouched)
    state = client.save_state("good").result().path
    sampler_path = client.save_weights_for_sampler("good").result().path

    def expect_error(call: object, *fragments: str) -> None:
        with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as info:
            call.result()  # type: ignore[attr-defined]
        for fragment in fragments:
            assert fragment in str(info.value), str(info.value)

    target = BATCH[0].loss_fn_inputs
    out_of_vocab = types.Datum(
        model_input=types.ModelInput.from_ints([1, 10**6, 3, 4, 5]), loss_fn_inputs=target
    )
    expect_error(client.forward_backward([BATCH[1], out_of_vocab], "cross_entropy"), "vocab")
    short_weights = datum([11, 42, 17, 99, 23, 5], [1.0, 1.0])
    expect_error(client.forward_backward([BATCH[1], short_weights], "cross_entropy"), "weights")
    expect_error(client.forward_backward(BATCH, "no_such_loss"), "no_such_loss")
    expect_error(client.forward_backward(BATCH, "ppo"), "advantages")
    expect_error(client.optim_step(types.AdamParams(learning_rate=float("nan"))), "adam_params")
    expect_error(client.save_state("../escape"), "invalid")
    expect_error(client.save_state("good"), "already exists")
    expect_error(service.create_training_client_from_state(f"{state}-missing"), "no checkpoint")
    expect_error(service.create_training_client_from_state_with_optimizer(sampler_path), "optimizer")
    expect_error(service.create_sampling_client(model_path=f"{sampler_path}-missing"), "no checkpoint")
    sampler = service.create_sampling_client(model_path=sampler_path).result()
    expect_error(
        sampler.sample(types.ModelInput.from_ints([5, 10**6]), 1, types.SamplingParams(max_tokens=2))
    )

    # Empty data never leaves the SDK (it raises locally), so send it raw.
    empty = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=[], loss_fn="cross_entropy"),
        model_id=client.model_id,
    )
    failure = _retrieve(engine, _post_proto(engine, empty)).json()
    assert failure["category"] == "user" and "empty" in failure["error"]
    unknown = types.ForwardBackwardRequest(
        forward_backward_input=types.ForwardBackwardInput(data=BATCH, loss_fn="cross_entropy"),
        model_id="nobody:train:0",
    )
    failure = _retrieve(engine, _post_proto(engine, unknown)).json()
    assert failure["category"] == "user" and "unknown model" in failure["error"]

    # Nothing above touched the weights, the Adam state or the accumulated gradients.
    assert train_step(client) == pytest.approx(train_step(untouched), abs=1e-5)
    np.testing.assert_allclose(fingerprint(client), fingerprint(untouched), atol=1e-6)


def test_rest_client_lists_runs_and_deletes_checkpoints(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = new_model(service, seed=2)
    state = client.save_state("kept").result().path
    doomed = client.save_weights_for_sampler("doomed").result().path
    rest = engine.rest_client()

    runs = {r.training_run_id: r for r in rest.list_training_runs(limit=100).result().training_runs}
    assert runs[client.model_id].base_model == TINY and runs[client.model_id].lora_rank == 4
    run = rest.get_training_run(client.model_id).result()
    assert run.last_checkpoint is not None and run.last_checkpoint.tinker_path == state

    listed = {c.tinker_path: c for c in rest.list_checkpoints(client.model_id).result().checkpoints}
    assert set(listed) == {state, doomed}
    assert listed[doomed].checkpoint_type == "sampler" and (listed[doomed].size_bytes or 0) > 0

    rest.delete_checkpoint_from_tinker_path(doomed).result()
    assert [c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints] == [state]
    assert not (engine.data_dir / "runs" / client.model_id / "sampler_weights" / "doomed").exists()
    with pytest.raises(tinker.NotFoundError):
        rest.delete_checkpoint_from_tinker_path(doomed).result()


def test_two_models_on_one_base_do_not_interfere(service: tinker.ServiceClient) -> None:
    a, b, b_alone = (new_model(service, seed=s) for s in (1, 2, 2))
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        list(pool.map(lambda c: [train_step(c) for _ in range(2)], [a, b]))
    train_step(b_alone)
    train_step(b_alone)
    np.testing.assert_allclose(fingerprint(b), fingerprint(b_alone), atol=1e-6)


def test_the_sdk_reaches_the_engine_through_its_native_transport(service: tinker.ServiceClient) -> None:
    """The engine's client config lets the SDK use its reqwest-based transport (pyqwest): on 2 cores it
    halves the SDK's own CPU per request against httpx's pool, whose every request polls each idle
    connection (64 concurrent 8-token samples: 0.90 -> 0.38 s)."""
    from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

    sampler = service.create_sampling_client(base_model=TINY).result()
    result = sampler.sample(types.ModelInput.from_ints([20, 21, 22]), 1, types.SamplingParams(max_tokens=2))
    assert len(result.result().sequences) == 1
    pools = sampler.holder._client_pools
    for pool_type in (ClientConnectionPoolType.SAMPLE, ClientConnectionPoolType.RETRIEVE_PROMISE):
        transports = {type(client._client._transport).__name__ for client in pools[pool_type]._clients}
        assert transports == {"AsyncPyqwestTransport"}, (pool_type, transports)
