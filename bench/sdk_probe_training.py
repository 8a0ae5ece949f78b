"""The SDK probe's ServiceClient and TrainingClient calls (see sdk_probe_core for the verdicts)."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types
from tinker.lib.retry_handler import RetryConfig

from bench.sdk_probe_core import (
    ADAM,
    BATCH,
    FINGERPRINT,
    TINY,
    Probe,
    Refused,
    call,
    expect,
    expect_close,
    expect_refused,
    fingerprint,
    refusal_or,
    train_step,
)


@call("ServiceClient.create_lora_training_client(base_model, rank, seed)")
def _create_lora(p: Probe) -> None:
    a, b = p.new_model(seed=7), p.new_model(seed=7)
    expect(a.get_info().lora_rank == 4, f"rank {a.get_info()}")
    train_step(a)
    train_step(b)
    expect_close(fingerprint(a), fingerprint(b), "same seed, same steps")


@call("ServiceClient.create_lora_training_client(train_mlp, train_attn, train_unembed)")
def _create_lora_parts(p: Probe) -> None:
    client = p.new_model(train_mlp=False, train_unembed=False)
    path = client.save_state("parts").result().path
    info = p.rest.get_weights_info_by_tinker_path(path).result()
    expect((info.train_mlp, info.train_attn, info.train_unembed) == (False, True, False), f"{info}")


@call("ServiceClient.create_lora_training_client(user_metadata)")
def _create_lora_metadata(p: Probe) -> None:
    client = p.new_model(user_metadata={"team": "probe"})
    run = p.rest.get_training_run(client.model_id).result()
    expect(run.user_metadata == {"team": "probe"}, f"user_metadata {run.user_metadata}")


@call("ServiceClient.create_lora_training_client(optimizer=AdamOptimizerConfig)")
def _create_adam(p: Probe) -> None:
    client = p.new_model(optimizer=types.AdamOptimizerConfig())
    before = fingerprint(client)
    train_step(client)
    expect(not np.allclose(fingerprint(client), before), "an Adam step changed nothing")


@call("ServiceClient.create_lora_training_client(optimizer=DimuonOptimizerConfig) + optim_step(DimuonParams)")
def _create_dimuon(p: Probe) -> None:
    client = refusal_or(lambda: p.new_model(optimizer=types.DimuonOptimizerConfig()), "optimizer")
    before = fingerprint(client)
    client.forward_backward(BATCH, "cross_entropy").result()
    try:
        client.optim_step(ADAM).result()
    except tinker.RequestFailedError:
        pass
    else:
        raise AssertionError("a Dimuon model ran an AdamParams step")
    client.optim_step(types.DimuonParams(learning_rate=0.02, beta1=0.9, grad_clip_norm=1.0)).result()
    expect(not np.allclose(fingerprint(client), before), "a Dimuon step changed nothing")


@call("ServiceClient.create_sampling_client(base_model)")
def _sampler_base(p: Probe) -> None:
    out = p.base_sampler.sample(types.ModelInput.from_ints([5, 6]), 2, types.SamplingParams(max_tokens=3))
    expect(len(out.result().sequences) == 2, "two samples asked")


@call("ServiceClient.create_sampling_client(model_path)")
def _sampler_path(p: Probe) -> None:
    sampler = p.service.create_sampling_client(model_path=p.sampler_path).result()
    prompt = types.ModelInput.from_ints([*FINGERPRINT[0].model_input.to_ints(), 37])
    expect_close(sampler.compute_logprobs(prompt).result()[1:], p.at_save, "sampler weights")


@call("ServiceClient.create_sampling_client(retry_config)")
def _sampler_retry(p: Probe) -> None:
    sampler = p.service.create_sampling_client(base_model=TINY, retry_config=RetryConfig()).result()
    expect(
        len(
            sampler.sample(types.ModelInput.from_ints([5]), 1, types.SamplingParams(max_tokens=2))
            .result()
            .sequences
        )
        == 1,
        "sample",
    )


@call("ServiceClient.create_training_client_from_state(path)")
def _from_state(p: Probe) -> None:
    expect_close(
        fingerprint(p.service.create_training_client_from_state(p.state_path).result()),
        p.at_save,
        "loaded weights",
    )


@call("ServiceClient.create_training_client_from_state(base_model, user_metadata)")
def _from_state_options(p: Probe) -> None:
    client = p.service.create_training_client_from_state(
        p.state_path, base_model=TINY, user_metadata={"from": "state"}
    ).result()
    expect(p.rest.get_training_run(client.model_id).result().user_metadata == {"from": "state"}, "metadata")


@call("ServiceClient.create_training_client_from_state(optimizer=AdamOptimizerConfig)")
def _from_state_adam(p: Probe) -> None:
    client = p.service.create_training_client_from_state(p.state_path, optimizer=types.AdamOptimizerConfig())
    expect_close(fingerprint(client.result()), p.at_save, "loaded weights")


@call("ServiceClient.create_training_client_from_state_with_optimizer(path)")
def _from_state_optimizer(p: Probe) -> None:
    a = p.service.create_training_client_from_state_with_optimizer(p.state_path).result()
    b = p.service.create_training_client_from_state_with_optimizer(
        p.state_path, base_model=TINY, user_metadata={"resumed": "b"}
    ).result()
    expect(p.rest.get_training_run(b.model_id).result().user_metadata == {"resumed": "b"}, "metadata")
    expect_close(fingerprint(a), p.at_save, "loaded weights")
    expect(abs(train_step(a) - train_step(b)) < 1e-5, "two resumes took different steps")
    expect_close(fingerprint(a), fingerprint(b), "two resumes")


@call("ServiceClient(project_id, user_metadata, display_name).copy_weights(path, ttl_seconds)")
def _copy_weights(p: Probe) -> None:
    # The copy lands in the ServiceClient's own project.
    archive = tinker.ServiceClient(
        user_metadata={"k": "v"},
        project_id="probe-archive",
        display_name="probe archive",
        base_url=p.engine.base_url,
        api_key=p.engine.api_key,
    )
    with archive:
        copied = archive.copy_weights(p.state_path, ttl_seconds=3600).result()
    expect(copied != p.state_path, "the copy has its own path")
    expect_close(fingerprint(p.service.create_training_client_from_state(copied).result()), p.at_save, "copy")


@call("ServiceClient.create_custom_loss + TrainingClient.forward_backward_custom(LossHandle)")
def _custom_loss(p: Probe) -> None:
    def neg_ll(logprobs, weights):  # type: ignore[no-untyped-def]
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = p.service.create_custom_loss(neg_ll, input_ranks={"logprobs": 1, "weights": 1}).result()
    client = p.new_model(seed=4)
    reference = client.forward(BATCH, "cross_entropy").result().metrics["loss:sum"]
    got = client.forward_backward_custom(BATCH, handle).result().metrics
    expect(abs(got["custom/neg_ll:sum"] - reference) < 1e-3, f"custom {got} vs cross_entropy {reference}")


@call("TrainingClient.forward_backward_custom(callable, loss_type_input)")
def _custom_callable(p: Probe) -> None:
    import torch

    def mean_lp(data, logprobs_list):  # type: ignore[no-untyped-def]
        loss = -torch.stack([lp.sum() for lp in logprobs_list]).sum()
        return loss, {"nll": float(loss)}

    client = p.new_model(seed=4)
    reference = client.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    total = -sum(float(o["logprobs"].to_numpy().sum()) for o in reference)
    got = client.forward_backward_custom(BATCH, mean_lp).result().metrics
    expect(abs(got["nll"] - total) < 1e-3, f"{got} vs {total}")


@call("ServiceClient.get_server_capabilities")
def _capabilities(p: Probe) -> None:
    names = [m.model_name for m in p.service.get_server_capabilities().supported_models]
    expect(TINY in names, f"{TINY} not in {names}")


@call("ServiceClient.get_console_url / get_telemetry / create_rest_client")
def _service_misc(p: Probe) -> None:
    expect(isinstance(p.service.get_console_url(), str), "console url")
    p.service.get_telemetry()
    expect(isinstance(p.service.create_rest_client(), tinker.RestClient), "rest client")


@call("ServiceClient.close(status, detail)")
def _close(p: Probe) -> None:
    for status in ("success", "interrupted"):
        other = tinker.ServiceClient(base_url=p.engine.base_url, api_key=p.engine.api_key)
        other.create_lora_training_client(TINY, rank=4).result()
        session = other.holder.get_session_id()
        other.close(status, detail="probe").result()
        request = types.SessionSearchRequest(session_id=session)
        [found] = p.rest.search_sessions(request).result().sessions
        expect(getattr(found.status, "detail", None) == "probe", f"{status}: {found.status}")


@call("TrainingClient.forward(cross_entropy)")
def _forward(p: Probe) -> None:
    out = p.trained.forward(BATCH, "cross_entropy").result()
    lps = [o["logprobs"].to_numpy() for o in out.loss_fn_outputs]
    weights = [d.loss_fn_inputs["weights"].to_numpy() for d in BATCH]
    want = -sum(float((lp * w).sum()) for lp, w in zip(lps, weights, strict=True))
    expect(abs(out.metrics["loss:sum"] - want) < 1e-3, "loss:sum is the weighted sum")


def _rl_batch(client: tinker.TrainingClient, loss: str, shift: float = 0.3) -> list[types.Datum]:
    out = client.forward(BATCH, "cross_entropy").result().loss_fn_outputs
    data = []
    for d, o in zip(BATCH, out, strict=True):
        lp = o["logprobs"].to_numpy()
        n = len(lp)
        data.append(
            types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={
                    "target_tokens": d.loss_fn_inputs["target_tokens"],
                    "logprobs": (lp - shift).astype(np.float32),
                    "advantages": np.linspace(-1, 1, n).astype(np.float32),
                    **({"sequence_ratio_mask": np.ones(n, dtype=np.float32)} if loss == "gspo" else {}),
                },
            )
        )
    return data


LOSS_CONFIGS: dict[str, dict[str, float]] = {
    "importance_sampling": {},
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {},
    "dro": {"beta": 0.1},
    "gspo": {},
    "stable_reinforce": {"kl_coeff": 0.01},
}


def _loss_call(loss: str) -> None:
    @call(f"TrainingClient.forward_backward(loss_fn={loss!r}, loss_fn_config)", slug=f"loss_{loss}")
    def _run(p: Probe) -> None:
        client = p.new_model(seed=5)
        data = _rl_batch(client, loss)
        scored = client.forward(data, loss, LOSS_CONFIGS[loss] or None).result()
        out = client.forward_backward(data, loss, LOSS_CONFIGS[loss] or None).result()
        expect(np.isfinite(out.metrics["loss:sum"]), f"{loss} loss {out.metrics}")
        expect(
            abs(scored.metrics["loss:sum"] - out.metrics["loss:sum"]) < 1e-4, "forward != forward_backward"
        )
        before = fingerprint(client)
        client.optim_step(ADAM).result()
        expect(not np.allclose(fingerprint(client), before), f"a {loss} step changed nothing")


for _loss in LOSS_CONFIGS:
    _loss_call(_loss)


def _soft_targets(sparse: bool) -> None:
    name = "sparse TensorData" if sparse else "dense"

    @call(
        f"TrainingClient.forward_backward(cross_entropy, [N, K] soft targets, {name})",
        slug=f"soft_targets_{'sparse' if sparse else 'dense'}",
    )
    def _run(p: Probe) -> None:
        client = p.new_model(seed=6)
        d = BATCH[0]
        tokens = d.loss_fn_inputs["target_tokens"].to_numpy()
        n = len(tokens)
        alt = (tokens + 1) % 100
        per_column = []
        for column, weight in ((tokens, 0.75), (alt, 0.25)):
            one = types.Datum(
                model_input=d.model_input,
                loss_fn_inputs={"target_tokens": column, "weights": np.full(n, weight, np.float32)},
            )
            per_column.append(client.forward([one], "cross_entropy").result().metrics["loss:sum"])
        targets = np.stack([tokens, alt], axis=1).astype(np.int64)
        weights = np.tile(np.asarray([0.75, 0.25], np.float32), (n, 1))
        if sparse:
            target_data = types.TensorData(
                data=targets.reshape(-1).tolist(),
                dtype="int64",
                shape=[n, 2],
                sparse_crow_indices=list(range(0, 2 * n + 1, 2)),
                sparse_col_indices=[0, 1] * n,
            )
            weight_data = types.TensorData(
                data=weights.reshape(-1).tolist(),
                dtype="float32",
                shape=[n, 2],
                sparse_crow_indices=list(range(0, 2 * n + 1, 2)),
                sparse_col_indices=[0, 1] * n,
            )
        else:
            target_data, weight_data = (
                types.TensorData.from_numpy(targets),
                types.TensorData.from_numpy(weights),
            )
        soft = types.Datum(
            model_input=d.model_input, loss_fn_inputs={"target_tokens": target_data, "weights": weight_data}
        )
        got = client.forward_backward([soft], "cross_entropy").result().metrics["loss:sum"]
        expect(abs(got - sum(per_column)) < 1e-3, f"[N, K] loss {got} != sum of columns {sum(per_column)}")


_soft_targets(sparse=False)
_soft_targets(sparse=True)


@call("TrainingClient.optim_step(AdamParams: every field)")
def _adam_fields(p: Probe) -> None:
    client = p.new_model(seed=8)
    before = fingerprint(client)
    train_step(
        client,
        types.AdamParams(
            learning_rate=1e-2, beta1=0.8, beta2=0.9, eps=1e-8, weight_decay=0.1, grad_clip_norm=1.0
        ),
    )
    after = fingerprint(client)
    expect(np.all(np.isfinite(after)) and not np.allclose(after, before), "the step changed nothing")


@call("TrainingClient.optim_step(optim_params=...) / optim_step(adam_params=...)")
def _adam_keyword(p: Probe) -> None:
    stepped = []
    for keyword in ("optim_params", "adam_params"):
        client = p.new_model(seed=8)
        client.forward_backward(BATCH, "cross_entropy").result()
        client.optim_step(**{keyword: ADAM}).result()
        stepped.append(fingerprint(client))
    before = fingerprint(p.new_model(seed=8))
    expect(not np.allclose(stepped[0], before), "the step changed nothing")
    expect_close(stepped[0], stepped[1], "optim_params and adam_params take the same step")


@call("TrainingClient.save_state(name, ttl_seconds, overwrite, user_metadata)")
def _save_state(p: Probe) -> None:
    client = p.new_model(seed=9)
    first = client.save_state("kept", ttl_seconds=3600, user_metadata={"k": "v"}).result().path
    train_step(client)
    again = client.save_state("kept", overwrite=True).result().path
    expect(first == again, "overwrite keeps the path")
    expect_close(
        fingerprint(p.service.create_training_client_from_state(again).result()),
        fingerprint(client),
        "overwritten state",
    )
    listed = {c.tinker_path: c for c in p.rest.list_checkpoints(client.model_id).result().checkpoints}
    expect(first in listed, "saved state listed")


@call("TrainingClient.save_weights_for_sampler(name, ttl_seconds, user_metadata)")
def _save_sampler(p: Probe) -> None:
    client = p.new_model(seed=10)
    path = client.save_weights_for_sampler("s", ttl_seconds=3600, user_metadata={"k": "v"}).result().path
    listed = {c.tinker_path: c for c in p.rest.list_checkpoints(client.model_id).result().checkpoints}
    expect(path in listed and listed[path].expires_at is not None, f"ttl not recorded: {listed.get(path)}")


@call("TrainingClient.save_weights_and_get_sampling_client(kind='snapshot')")
def _snapshot(p: Probe) -> None:
    client = p.new_model(seed=15)
    train_step(client)
    at_save = fingerprint(client)
    sampler = client.save_weights_and_get_sampling_client(kind="snapshot").result()
    prompt = types.ModelInput.from_ints([*FINGERPRINT[0].model_input.to_ints(), 37])
    expect_close(sampler.compute_logprobs(prompt).result()[1:], at_save, "snapshot weights")
    train_step(client)
    client.save_weights_and_get_sampling_client().result()
    expect_close(sampler.compute_logprobs(prompt).result()[1:], at_save, "a snapshot followed a later save")


@call("TrainingClient.save_weights_and_get_sampling_client(kind='inflight')")
def _inflight(p: Probe) -> None:
    client = p.new_model(seed=12)
    train_step(client)
    first = client.save_weights_and_get_sampling_client(kind="inflight").result()
    train_step(client)
    second = client.save_weights_and_get_sampling_client(kind="inflight").result()
    prompt = types.ModelInput.from_ints([*FINGERPRINT[0].model_input.to_ints(), 37])
    now = fingerprint(client)
    expect_close(second.compute_logprobs(prompt).result()[1:], now, "the newer inflight client")
    expect_close(
        first.compute_logprobs(prompt).result()[1:], now, "the older inflight client follows the save"
    )


@call("TrainingClient.save_weights_and_get_sampling_client(name, record_stability_info, retry_config)")
def _snapshot_options(p: Probe) -> None:
    client = p.new_model(seed=14)
    sampler = client.save_weights_and_get_sampling_client(
        name="ignored", retry_config=RetryConfig(), record_stability_info=True
    ).result()
    prompt = types.ModelInput.from_ints([*FINGERPRINT[0].model_input.to_ints(), 37])
    expect_close(sampler.compute_logprobs(prompt).result()[1:], fingerprint(client), "snapshot weights")
    # The SDK deprecates `name` as having no effect: the snapshot stays ephemeral, never a named checkpoint.
    listed = [c.tinker_path for c in p.rest.list_checkpoints(client.model_id).result().checkpoints]
    expect(not any(path.endswith("/ignored") for path in listed), f"a checkpoint named by it: {listed}")


@call("TrainingClient.create_sampling_client(model_path, retry_config)")
def _tc_sampler(p: Probe) -> None:
    sampler = p.trained.create_sampling_client(p.sampler_path, retry_config=RetryConfig()).result()
    prompt = types.ModelInput.from_ints([*FINGERPRINT[0].model_input.to_ints(), 37])
    expect_close(sampler.compute_logprobs(prompt).result()[1:], p.at_save, "sampler weights")


@call("TrainingClient.load_state(path) / load_state_with_optimizer(path)")
def _load_state(p: Probe) -> None:
    for load in ("load_state", "load_state_with_optimizer"):
        client = p.new_model(seed=13)
        getattr(client, load)(p.state_path).result()
        expect_close(fingerprint(client), p.at_save, load)


@call("TrainingClient.get_info / get_tokenizer / get_console_url / get_telemetry")
def _tc_misc(p: Probe) -> None:
    info = p.trained.get_info()
    expect(info.model_id == p.trained.model_id and info.lora_rank == 4, f"{info}")
    expect(len(p.trained.get_tokenizer().encode("hello")) > 0, "tokenizer")
    expect(isinstance(p.trained.get_console_url(), str), "console url")
    p.trained.get_telemetry()


@call("TrainingClient.save_weights_external(name, ttl_seconds) + RestClient.get_external_weights_urls")
def _external(p: Probe) -> None:
    import httpx

    path = p.trained.save_weights_external("ext", ttl_seconds=3600).result().path
    urls = p.rest.get_external_weights_urls(path).result().urls
    expect(len(urls) > 0, "no urls")
    expect(all(len(httpx.get(url).content) > 0 for url in urls.values()), "an empty download")


@call("TrainingClient.save_weights_external(age_encryption_recipients)")
def _external_age(p: Probe) -> None:
    import httpx
    import pyrage

    identity = pyrage.x25519.Identity.generate()
    save = p.trained.save_weights_external("ext-age", age_encryption_recipients=[str(identity.to_public())])
    path = refusal_or(lambda: save.result(), "age_encryption_recipients").path
    urls = p.rest.get_external_weights_urls(path).result().urls
    for url in urls.values():
        body = httpx.get(url).content
        expect(body.startswith(b"age-encryption.org/v1"), "a file is not age-encrypted")
        pyrage.decrypt(body, [identity])


@call("ServiceClient(default_headers_overrides)")
def _service_headers(p: Probe) -> None:
    with tinker.ServiceClient(
        base_url=p.engine.base_url, api_key=p.engine.api_key, default_headers_overrides={"X-Probe": "1"}
    ) as other:
        names = [m.model_name for m in other.get_server_capabilities().supported_models]
        expect(TINY in names, f"{names}")
        client = other.create_lora_training_client(TINY, rank=4, seed=1).result()
        expect_close(fingerprint(client), fingerprint(p.new_model(seed=1)), "a client made through it")


@call("TrainingClient.forward_backward(loss_fn='custom') sent directly (refused: no uploaded losses)")
def _custom_loss_fn(p: Probe) -> None:
    client = p.new_model(seed=16)
    before = fingerprint(client)
    expect_refused(client.forward(BATCH, "custom", {"loss_id": 1.0}).result, "custom")
    message = expect_refused(client.forward_backward(BATCH, "custom", {"loss_id": 1.0}).result, "custom")
    expect(np.allclose(fingerprint(client), before), "a refused request changed the weights")
    train_step(client)  # the client goes on
    raise Refused(message[:200])
