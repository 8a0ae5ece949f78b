"""The SDK probe's `_async` variants: each awaited as an asyncio user awaits it, answering as its sync twin."""

from __future__ import annotations

import asyncio
import datetime as dt
from typing import Any

import numpy as np
from tinker import types

from bench.sdk_probe_core import ADAM, BATCH, PROMPT, TINY, Probe, call, expect, expect_close, fingerprint


async def _result(awaitable: Any) -> Any:
    """An `_async` call's answer: some return it, some a future of it (the SDK's APIFuture)."""
    answer = await awaitable
    return await answer.result_async() if hasattr(answer, "result_async") else answer


def _run(coroutine: Any) -> Any:
    """On the caller's own event loop, as an asyncio user runs the SDK (the SDK keeps its own loop)."""
    return asyncio.run(coroutine)


@call("ServiceClient / TrainingClient / SamplingClient *_async")
def _training_async(p: Probe) -> None:
    async def run() -> None:
        client = await p.service.create_lora_training_client_async(TINY, rank=4, seed=31)
        before = fingerprint(client)
        out = await _result(client.forward_backward_async(BATCH, "cross_entropy"))
        scored = await _result(client.forward_async(BATCH, "cross_entropy"))
        expect(abs(out.metrics["loss:sum"] - scored.metrics["loss:sum"]) < 1e-4, "forward_async")
        await _result(client.optim_step_async(ADAM))
        expect(not np.allclose(fingerprint(client), before), "optim_step_async changed nothing")
        expect((await client.get_info_async()).model_id == client.model_id, "get_info_async")
        state = (await _result(client.save_state_async("async"))).path
        sampler_path = (await _result(client.save_weights_for_sampler_async("async"))).path
        loaded = await p.service.create_training_client_from_state_async(state)
        resumed = await p.service.create_training_client_from_state_with_optimizer_async(state)
        for other in (loaded, resumed):
            expect_close(fingerprint(other), fingerprint(client), "loaded from the async save")
        await _result(loaded.load_state_async(state))
        await _result(resumed.load_state_with_optimizer_async(state))
        snapshot = await client.save_weights_and_get_sampling_client_async()
        by_path = await client.create_sampling_client_async(sampler_path)
        base = await p.service.create_sampling_client_async(base_model=TINY)
        expect(await base.get_base_model_async() == TINY, "get_base_model_async")
        sampled = await base.sample_async(PROMPT, 2, types.SamplingParams(max_tokens=3, seed=1))
        expect(len(sampled.sequences) == 2, "sample_async")

        def neg_ll(data: list[types.Datum], logprobs: list[Any]) -> tuple[Any, dict[str, float]]:
            loss = -sum(
                (lp * d.loss_fn_inputs["weights"].to_torch()).sum()
                for d, lp in zip(data, logprobs, strict=True)
            )
            return loss, {"nll": float(loss)}

        custom = await _result(client.forward_backward_custom_async(BATCH, neg_ll))
        now = await _result(client.forward_async(BATCH, "cross_entropy"))
        expect(abs(custom.metrics["nll"] - now.metrics["loss:sum"]) < 1e-3, "forward_backward_custom_async")
        expect_close(
            (await snapshot.compute_logprobs_async(PROMPT))[1:],
            (await by_path.compute_logprobs_async(PROMPT))[1:],
            "the snapshot and the saved sampler weights",
        )
        names = [m.model_name for m in (await p.service.get_server_capabilities_async()).supported_models]
        expect(TINY in names, "get_server_capabilities_async")
        external = (await _result(client.save_weights_external_async("async-ext"))).path
        expect(bool((await p.rest.get_external_weights_urls_async(external)).urls), "no urls")

    _run(run())


@call("RestClient / AdminClient *_async")
def _rest_async(p: Probe) -> None:
    async def run() -> None:
        model_id = p.trained.model_id
        runs = (await p.rest.list_training_runs_async(limit=100)).training_runs
        expect(model_id in [r.training_run_id for r in runs], "list_training_runs_async")
        expect(
            (await p.rest.get_training_run_async(model_id)).training_run_id == model_id, "get_training_run"
        )
        by_path = await p.rest.get_training_run_by_tinker_path_async(p.state_path)
        expect(by_path.training_run_id == model_id, "get_training_run_by_tinker_path_async")
        listed = [c.tinker_path for c in (await p.rest.list_checkpoints_async(model_id)).checkpoints]
        everyone = (await p.rest.list_user_checkpoints_async(limit=1000)).checkpoints
        expect(p.state_path in listed and p.state_path in [c.tinker_path for c in everyone], "listings")
        path = (await _result(p.trained.save_weights_for_sampler_async("async-rest"))).path
        await p.rest.set_checkpoint_ttl_from_tinker_path_async(path, 3600)
        await p.rest.publish_checkpoint_from_tinker_path_async(path)
        await p.rest.unpublish_checkpoint_from_tinker_path_async(path)
        copied = await p.rest.copy_weights_async(p.state_path, "probe-async")
        expect_close(
            fingerprint(p.service.create_training_client_from_state(copied).result()), p.at_save, "copy"
        )
        await p.rest.delete_checkpoint_from_tinker_path_async(path)
        second = (await _result(p.trained.save_weights_for_sampler_async("async-gone"))).path
        await p.rest.delete_checkpoint_async(model_id, "sampler_weights/async-gone")
        left = [c.tinker_path for c in (await p.rest.list_checkpoints_async(model_id)).checkpoints]
        expect(path not in left and second not in left, "deleted checkpoints listed")
        session = p.service.holder.get_session_id()
        expect(session in (await p.rest.list_sessions_async(limit=100)).sessions, "list_sessions_async")
        expect(model_id in (await p.rest.get_session_async(session)).training_run_ids, "get_session_async")
        await p.rest.assign_session_project_async(session, "probe-async")
        expect(bool(await p.rest.export_session_trace_async(session)), "export_session_trace_async")
        sampler = p.service.create_sampling_client(model_path=p.sampler_path).result()
        got = await p.rest.get_sampler_async(sampler._sampling_session_id)
        expect(got.model_path == p.sampler_path, "get_sampler_async")
        hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
        for owner in (p.rest, p.admin):
            expect(len((await owner.get_audit_log_async()).entries) > 0, "get_audit_log_async")
            await owner.get_billing_usage_async(hour - dt.timedelta(hours=1), hour)
            usage = await owner.get_current_checkpoint_storage_usage_async()
            expect(sum(item.checkpoint_count for item in usage.data) > 0, "storage usage")

    _run(run())
