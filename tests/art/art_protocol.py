"""ART 0.5.20+'s requests and Backend calls (art_0_5_2x_corpus.json, recorded from its source) replayed
through `tinkerrpc serve --sidecar-port` and TinkerRPCBackend; run by test_art_protocol.py in its own
process (`import art` patches transformers in its process, see test_art.py).

ART 0.5.20+ needs Python 3.12 and cannot run here, so this plays its part with the corpus: every chat
completion carries the extras its model.openai_client() merges in (nvext, preserve_thinking, ...), and
rollouts take the two forms its trajectories have, built as ART builds them from the sidecar's answers:
`messages_and_choices` whose Choices carry the response's prompt_token_ids (ART's client copies them on),
and `exchanges` as its capture records each request and response (multi-turn tool calls, legacy
completions, Responses), passed to train() as their model_dump(). Then every train() keyword set of the
corpus, PipelineTrainer's adapter leases (rollouts and eval pinned to a version) and its checkpoint
deletion. Every check asserts here; the last line printed is a JSON summary.

Usage: art_protocol.py ART_PATH GRPC_TARGET
"""

from __future__ import annotations

import asyncio
import json
import re
import sys
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import art
import openai
import pytest

import tinkerrpc
from tinkerrpc.art import TinkerRPCBackend
from tinkerrpc.art._trajectories import convert_groups
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.sidecar.extensions import IGNORED_FIELDS_HEADER

CORPUS: dict[str, Any] = json.loads(Path(__file__).with_name("art_0_5_2x_corpus.json").read_text())
ART_EXTRAS = {k: v for k, v in CORPUS["chat_extra_body"].items() if not k.startswith("_")}
IGNORED_ART_EXTRAS = "nvext, chat_template_kwargs.preserve_thinking"
TIMEOUT = 100.0


def with_model(body: dict[str, Any], model: str) -> dict[str, Any]:
    return {k: (model if v == "{model}" else v) for k, v in body.items() if not k.startswith("_")}


def art_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """The body ART 0.5.20+'s client sends: its extras under the caller's, nested dicts merged
    (art/model.py, _merge_extra_body_defaults)."""
    merged = {**ART_EXTRAS}
    for key, value in body.items():
        merged[key] = (
            {**merged[key], **value}
            if isinstance(value, dict) and isinstance(merged.get(key), dict)
            else value
        )
    return merged


def now() -> str:
    return datetime.now(UTC).isoformat()


async def send(api: openai.AsyncOpenAI, kind: str, body: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """One request as sent (the whole body as JSON); the response as received and the ignored-fields header."""
    endpoint = {
        "chat_completions": api.chat.completions,
        "completions": api.completions,
        "responses": api.responses,
    }[kind]
    fixed = {k: body[k] for k in ("model", "messages", "prompt", "input") if k in body}
    extra = {k: v for k, v in body.items() if k not in fixed}
    raw = await endpoint.with_raw_response.create(**fixed, extra_body=extra, timeout=TIMEOUT)  # type: ignore[attr-defined]
    response = json.loads(raw.text)
    if kind == "chat_completions" and body.get("return_token_ids") is not False:
        # ART 0.5.20+'s client raises unless the choices' token counts add up to the usage
        # (preprocessing/vllm_tokens.py, attach_completion_token_metadata).
        counts = [len(choice["token_ids"]) for choice in response["choices"]]
        assert sum(counts) == response["usage"]["completion_tokens"], (counts, response["usage"])
    return response, raw.headers.get(IGNORED_FIELDS_HEADER)


async def exchange(api: openai.AsyncOpenAI, kind: str, body: dict[str, Any]) -> dict[str, Any]:
    """A captured exchange as ART 0.5.20+'s capture records it (trajectories/_capture/core.py)."""
    start = now()
    response, ignored = await send(api, kind, body)
    if kind == "chat_completions":
        assert ignored == IGNORED_ART_EXTRAS, ignored
    return {"request": body, "response": response, "start_time": start, "end_time": now()}


def exchange_trajectory(reward: float, **exchanges: list[dict[str, Any]]) -> dict[str, Any]:
    kinds = {
        kind: exchanges.get(kind, []) for kind in ("chat_completions", "completions", "responses", "messages")
    }
    return {"exchanges": kinds, "reward": reward, "metrics": {}, "metadata": {}, "logs": []}


def choice_trajectories(
    messages: list[dict[str, Any]], response: dict[str, Any], rewards: list[float]
) -> list[dict[str, Any]]:
    """`messages_and_choices` trajectories, one per choice, each Choice carrying the response's prompt ids
    as ART 0.5.20+'s client attaches them (preprocessing/vllm_tokens.py)."""
    return [
        {
            "messages_and_choices": [*messages, {**choice, "prompt_token_ids": response["prompt_token_ids"]}],
            "reward": reward,
        }
        for choice, reward in zip(response["choices"], rewards, strict=True)
    ]


async def tool_rollout(api: openai.AsyncOpenAI, model: str) -> list[dict[str, Any]]:
    """Two chat exchanges of one agent rollout: a forced tool call, then the reply after its result."""
    plan = CORPUS["tool_rollout"]
    first_body = art_chat_body({**with_model(plan["first"], model), "tools": plan["tools"]})
    first = await exchange(api, "chat_completions", first_body)
    reply = first["response"]["choices"][0]["message"]
    follow_up = (
        [
            {"role": "tool", "tool_call_id": call["id"], "content": plan["tool_result"]}
            for call in reply["tool_calls"]
        ]
        if reply.get("tool_calls")
        else [{"role": "user", "content": "And tomorrow?"}]
    )
    second_body = art_chat_body(
        {
            "model": model,
            "messages": [*first_body["messages"], reply, *follow_up],
            "tools": plan["tools"],
            "max_tokens": plan["second_max_tokens"],
        }
    )
    return [first, await exchange(api, "chat_completions", second_body)]


async def rollout_group(api: openai.AsyncOpenAI, model: str) -> list[dict[str, Any]]:
    """One group of every rollout form, with distinct rewards (the protocol, not the task, is tested)."""
    chat = CORPUS["chat_requests"]
    body = art_chat_body(with_model(chat[0]["body"], model))
    response, ignored = await send(api, "chat_completions", body)
    assert ignored == IGNORED_ART_EXTRAS, ignored
    group = choice_trajectories(body["messages"], response, [1.0, 0.0, 0.5, 0.25])
    group.append(exchange_trajectory(0.75, chat_completions=await tool_rollout(api, model)))
    logprobs = await exchange(api, "chat_completions", art_chat_body(with_model(chat[2]["body"], model)))
    group.append(exchange_trajectory(0.1, chat_completions=[logprobs]))
    completion = await exchange(api, "completions", with_model(CORPUS["completions_request"]["body"], model))
    group.append(exchange_trajectory(0.6, completions=[completion]))
    responses = await exchange(api, "responses", with_model(CORPUS["responses_request"]["body"], model))
    group.append(exchange_trajectory(0.9, responses=[responses]))
    return group


def check_other_models_and_forms(group: list[dict[str, Any]], model: str) -> None:
    """Exchanges with another model (a judge) are not trained, a rollout with none of this model's is
    refused naming what it has, Anthropic Messages (no sidecar route) are refused, and a Choice without
    prompt ids (ART 0.5.18's) leaves the prompt to the server's re-rendering."""
    tool_rollout = group[4]["exchanges"]["chat_completions"]
    judge_request = {"model": "gpt-4.1-judge", "messages": [{"role": "user", "content": "Grade it."}]}
    judge = {
        **tool_rollout[0],
        "request": judge_request,
        "response": {"choices": [{"message": {"content": "8"}}]},
    }
    with_judge = exchange_trajectory(0.75, chat_completions=[tool_rollout[0], judge, tool_rollout[1]])
    (converted,) = convert_groups([{"trajectories": [with_judge]}], model)
    assert len(converted.trajectories[0].turns) == 2, "the judge's exchange is not a turn"
    with pytest.raises(ValueError, match=r"no exchanges with model .*gpt-4\.1-judge"):
        convert_groups([{"trajectories": [exchange_trajectory(0.0, chat_completions=[judge])]}], model)
    anthropic = {**tool_rollout[0], "request": {**tool_rollout[0]["request"], "model": f"{model}@0"}}
    with pytest.raises(ValueError, match="Anthropic Messages"):
        convert_groups([{"trajectories": [exchange_trajectory(0.0, messages=[anthropic])]}], model)
    legacy = dict(group[0])
    legacy["messages_and_choices"] = [
        *legacy["messages_and_choices"][:-1],
        {k: v for k, v in legacy["messages_and_choices"][-1].items() if k != "prompt_token_ids"},
    ]
    (old_form,) = convert_groups([{"trajectories": [legacy]}], model)
    assert old_form.trajectories[0].turns[0].prompt_token_ids == ()


def check_token_exact(group: list[dict[str, Any]], model: str) -> int:
    """Every converted turn is the sampler's tokens exactly: the prompt ids the sidecar answered and the
    ids it drew, per choice and per exchange, in order; returns the completion tokens."""
    (converted,) = convert_groups([{"trajectories": group}], model)
    total = 0
    for raw, trajectory in zip(group, converted.trajectories, strict=True):
        if "messages_and_choices" in raw:
            choice = raw["messages_and_choices"][-1]
            expected = [(choice["prompt_token_ids"], choice["token_ids"])]
        else:
            expected = []
            for kind, exchanges in raw["exchanges"].items():
                for ex in exchanges:
                    response = ex["response"]
                    if kind == "responses":
                        item = next(i for i in response["output"] if i.get("token_ids") is not None)
                        expected.append((item["prompt_token_ids"], item["token_ids"]))
                    else:
                        expected.extend(
                            (response["prompt_token_ids"], c["token_ids"]) for c in response["choices"]
                        )
        got = [(list(t.prompt_token_ids), list(t.completion_token_ids)) for t in trajectory.turns]
        assert got == expected, (got, expected)
        assert all(t.sample_key for t in trajectory.turns), (
            "every turn names the server's copy of its logprobs"
        )
        total += sum(len(t.completion_token_ids) for t in trajectory.turns)
    assert len(converted.trajectories[4].turns) == 2, "the tool rollout's two exchanges are two turns"
    return total


async def state_versions(target: str, name: str) -> set[int]:
    async with tinkerrpc.AsyncClient(target) as client:
        return {
            c.policy_version
            for c in await client.model(name).checkpoints()
            if c.kind == "state" and not c.automatic
        }


async def replay_train_calls(
    backend: TinkerRPCBackend, model: art.TrainableModel, api: openai.AsyncOpenAI, target: str
) -> list[dict[str, Any]]:
    outcomes = []
    for call in CORPUS["train_calls"]:
        before = await model.get_step()
        group = await rollout_group(api, model.get_inference_name())
        completion_tokens = check_token_exact(group, model.name)
        check_other_models_and_forms(group, model.name)
        expect = call["expect"]
        if expect != "trains":
            error = {"ValueError": ValueError, "TypeError": TypeError}[expect["error"]]
            with pytest.raises(error, match=re.escape(expect["match"])):
                await backend.train(model, [{"trajectories": group}], **call["kwargs"])
            assert await model.get_step() == before, f"{call['label']}: nothing trained"
            outcomes.append({"label": call["label"], "refused": True})
            continue
        result = await backend.train(model, [{"trajectories": group}], **call["kwargs"])
        assert result.step == before + 1 == await model.get_step(), call["label"]
        # Token-exact: every turn's sample key matched its tokens, so the server scored none of them.
        assert result.metrics["data/step_scored_tokens"] == 0, (call["label"], result.metrics)
        assert result.metrics["data/step_trainer_tokens"] == completion_tokens, (
            call["label"],
            result.metrics,
            completion_tokens,
        )
        # ART's metric of the KL penalty (the mean sampler − reference logprob), reported when one is asked.
        assert ("loss/kl_policy_ref" in result.metrics) == bool(call["kwargs"].get("kl_penalty_coef")), call[
            "label"
        ]
        interval = call["kwargs"].get("optimizer_save_interval")
        saves = call["kwargs"].get("save_checkpoint", False) or (
            interval is not None and result.step % interval == 0
        )
        assert (result.step in await state_versions(target, model.name)) == saves, call["label"]
        outcomes.append({"label": call["label"], "step": result.step, "state_saved": saves})
    return outcomes


def span_versions(choice: dict[str, Any]) -> set[int]:
    """The versions a choice's policy_token_spans name, checked as ART 0.5.20+'s PipelineTrainer checks an
    eval's Choices (_validated_policy_spans): a non-empty, contiguous partition of its tokens."""
    spans = choice["policy_token_spans"]
    assert spans, "PipelineTrainer's eval requires policy_token_spans"
    cursor = 0
    for span in spans:
        assert set(span) == {
            "start_token",
            "end_token",
            "generation_id",
            "policy_version",
            "lora_slot",
            "update_seq",
        }
        assert span["start_token"] == cursor < span["end_token"] and span["generation_id"], span
        cursor = span["end_token"]
    assert cursor == len(choice["token_ids"])
    return {span["policy_version"] for span in spans}


async def pinned_versions(api: openai.AsyncOpenAI, model: art.TrainableModel) -> list[int]:
    """The versions that sample ART's rollouts made with model.get_inference_name(), two tasks at once
    (each choice's stamp and its policy spans agree)."""
    body = art_chat_body(with_model(CORPUS["chat_requests"][1]["body"], model.get_inference_name()))
    answers = await asyncio.gather(*(send(api, "chat_completions", body) for _ in range(2)))
    choices = [choice for response, _ in answers for choice in response["choices"]]
    assert all(span_versions(c) == {c["policy_version"]} for c in choices)
    return [choice["policy_version"] for choice in choices]


async def replay_leases(
    backend: TinkerRPCBackend, model: art.TrainableModel, api: openai.AsyncOpenAI
) -> dict[str, Any]:
    # PipelineTrainer._validate_backend_support and _adapter_lease's checks.
    assert callable(getattr(backend, "exact_adapter_lease", None))
    assert hasattr(type(backend), "adapter_lease")
    latest = await model.get_step()
    pinned = 1
    async with backend.adapter_lease(model, pinned):
        assert model.get_inference_name() == f"{model.name}@{pinned}"
        assert await pinned_versions(api, model) == [pinned, pinned]
    assert model.get_inference_name() == f"{model.name}@{latest}"
    # The checkpoints ART keeps (its leased and latest steps) stay sampleable; the others go.
    await backend._delete_checkpoint_files(model, [pinned, latest])
    async with backend.exact_adapter_lease(model, pinned):
        assert await pinned_versions(api, model) == [pinned, pinned]
    with pytest.raises(ValueError, match=f"cannot sample policy version {latest - 1}"):
        async with backend.exact_adapter_lease(model, latest - 1):
            pass
    assert await pinned_versions(api, model) == [latest, latest]
    return {"pinned": pinned, "latest": latest}


async def replay(art_path: str, target: str) -> dict[str, Any]:
    backend = TinkerRPCBackend(target, path=art_path)
    model = art.TrainableModel(
        name="art-0-5-2x",
        project="art-protocol",
        base_model=TINY_CHAT,
        _internal_config={"tinker_native_args": {"training_client_args": {"rank": 8, "seed": 0}}},
    )
    await model.register(backend)
    base_url, api_key = await backend._prepare_backend_for_training(model, None)
    assert await backend._get_step(model) == 0
    # ART 0.5.20+'s client, played by openai's with its extras (0.5.18's own client would not add them).
    api = openai.AsyncOpenAI(base_url=base_url, api_key=api_key, max_retries=0)
    try:
        # Each chat body of the corpus is answered, naming what it ignored.
        for entry in CORPUS["chat_requests"]:
            response, ignored = await send(
                api, "chat_completions", art_chat_body(with_model(entry["body"], model.get_inference_name()))
            )
            assert ignored == IGNORED_ART_EXTRAS, (entry["label"], ignored)
            assert response["prompt_token_ids"] and all(c["token_ids"] for c in response["choices"]), entry[
                "label"
            ]
        # Without the RL fields, no spans either.
        plain_body = {
            **with_model(CORPUS["chat_requests"][1]["body"], model.get_inference_name()),
            "return_token_ids": False,
        }
        plain, _ = await send(api, "chat_completions", plain_body)
        assert not {"token_ids", "policy_token_spans"} & set(plain["choices"][0])
        train_calls = await replay_train_calls(backend, model, api, target)
        leases = await replay_leases(backend, model, api)
    finally:
        await api.close()
        await backend.close()
    return {"train_calls": train_calls, "leases": leases}


if __name__ == "__main__":
    print(json.dumps(asyncio.run(replay(*sys.argv[1:]))))
