"""Top-K logprobs through the Sample RPC and the SDK's Model.sample, against real servers on tiny-chat.

The sampled tokens' top-K come with the sample on the embedded engine (topk_sample_logprobs); a serve at
another Tinker (`--tinker-url`, here a separately started engine) takes them from a second pass over
prompt + completion. With the same seed both give the same tokens and the same top-K. Prompt top-K
(prompt_top_logprobs) are the engine's topk_prompt_logprobs, as the tinker SDK reads them itself.

A fresh model is its base model (LoRA starts at zero), so models on the two servers and the engine's base
model all score alike."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
import tinker
from svc import CALL_TIMEOUT, Server, violated_fields

import tinkerrpc
from tinkerrpc.contract.limits import MAX_TOP_LOGPROBS
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

BASE = "tinkerrpc/tiny-chat"
PROMPT = "The quick brown fox jumps over"
K = 5


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("topk-engine")
    with LocalEngine(tmp / "data", service_model_dir, tmp / "engine.log", startup_timeout=240) as running:
        yield running


@pytest.fixture(scope="module")
def remote(
    tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path, engine: LocalEngine
) -> Iterator[tinkerrpc.Model]:
    """A model on a serve whose Tinker (the engine above) is not its own: the second-pass path."""
    tmp = tmp_path_factory.mktemp("topk-remote")
    env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
    server = Server(tmp / "data", service_model_dir, tmp / "serve.log", env, "--tinker-url", engine.base_url)
    try:
        with tinkerrpc.Client(server.proc.target) as client:
            client.create_model("topk-remote", base_model=BASE, lora_rank=8)
            yield client.model("topk-remote")
    finally:
        assert server.close() == 0


@pytest.fixture(scope="module")
def native(server: Server) -> Iterator[tinkerrpc.Model]:
    """A model on the shared serve with its embedded engine: top-K with the sample."""
    with tinkerrpc.Client(server.proc.target) as client:
        client.create_model("topk-native", base_model=BASE, lora_rank=8)
        yield client.model("topk-native")


def _pairs(alternatives: tuple[tinkerrpc.TopLogprob, ...]) -> list[tuple[int, float]]:
    return [(a.token_id, a.logprob) for a in alternatives]


def _same_top(ours: list[tuple[int, float]], theirs: list[tuple[int, float]]) -> None:
    assert [t for t, _ in ours] == [t for t, _ in theirs]
    assert [lp for _, lp in ours] == pytest.approx([lp for _, lp in theirs], abs=1e-4)


def test_sampled_top_k_comes_with_the_sample_and_equals_the_second_pass(
    native: tinkerrpc.Model, remote: tinkerrpc.Model
) -> None:
    options = tinkerrpc.SamplingOptions(
        n=2, max_tokens=10, seed=11, top_logprobs=K, ignore_default_stops=True, return_token_texts=True
    )
    with_sample = native.sample(PROMPT, options=options)
    second_pass = remote.sample(PROMPT, options=options)
    for ours, theirs in zip(with_sample, second_pass, strict=True):
        assert ours.tokens == theirs.tokens and len(ours.top_logprobs) == len(ours.tokens) == 10
        for position, token in enumerate(ours.tokens):
            top = ours.top_logprobs[position]
            _same_top(_pairs(top), _pairs(theirs.top_logprobs[position]))
            assert [a.logprob for a in top] == sorted((a.logprob for a in top), reverse=True)
            assert all(a.text for a in top)
            # The sampled token, where it ranks within K, is listed with its own logprob.
            listed = {a.token_id: a.logprob for a in top}
            if token in listed:
                assert listed[token] == pytest.approx(ours.logprobs[position], abs=1e-5)
            else:
                assert ours.logprobs[position] <= top[-1].logprob + 1e-5


def test_sampled_top_k_are_from_the_distribution_each_token_was_drawn_from(
    native: tinkerrpc.Model, remote: tinkerrpc.Model
) -> None:
    """At temperature 0.5 the embedded engine's top-K are its sampler's (temperature applied), so each
    sampled token within them is listed with its own logprob; a second pass would have scored them at
    temperature 1, as the remote serve does."""
    options = tinkerrpc.SamplingOptions(
        max_tokens=12, seed=2, temperature=0.5, top_logprobs=K, ignore_default_stops=True
    )
    (with_sample,) = native.sample(PROMPT, options=options)
    (second_pass,) = remote.sample(PROMPT, options=options)
    assert with_sample.tokens == second_pass.tokens
    listed_once = False
    for position, token in enumerate(with_sample.tokens):
        ours = {a.token_id: a.logprob for a in with_sample.top_logprobs[position]}
        theirs = {a.token_id: a.logprob for a in second_pass.top_logprobs[position]}
        if token in ours:
            listed_once = True
            assert ours[token] == pytest.approx(with_sample.logprobs[position], abs=1e-5)
            # The remote serve's pass scored it at temperature 1, not as it was drawn.
            assert theirs.get(token) != pytest.approx(second_pass.logprobs[position], abs=1e-3)
    assert listed_once


def test_prompt_top_k_are_the_engines_topk_prompt_logprobs(
    native: tinkerrpc.Model, remote: tinkerrpc.Model, engine: LocalEngine
) -> None:
    options = tinkerrpc.SamplingOptions(
        max_tokens=1, seed=0, include_prompt_logprobs=True, prompt_top_logprobs=K, return_token_texts=True
    )
    (sample,) = native.sample(PROMPT, options=options)
    (remote_sample,) = remote.sample(PROMPT, options=options)
    prompt = list(sample.prompt_token_ids)
    assert remote_sample.prompt_token_ids == sample.prompt_token_ids
    sampler = engine.service_client().create_sampling_client(base_model=BASE).result(timeout=CALL_TIMEOUT)
    sdk = sampler.sample(
        tinker.types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=tinker.types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=K,
    ).result(timeout=CALL_TIMEOUT)
    sdk_rows = sdk.topk_prompt_logprobs or []
    assert len(sample.prompt_top_logprobs) == len(prompt) == len(sdk_rows)
    assert sample.prompt_top_logprobs[0] == () and math.isnan(sample.prompt_logprobs[0])
    for position in range(1, len(prompt)):
        top = _pairs(sample.prompt_top_logprobs[position])
        assert len(top) == K and all(a.text for a in sample.prompt_top_logprobs[position])
        _same_top(top, list(sdk_rows[position] or []))
        _same_top(top, _pairs(remote_sample.prompt_top_logprobs[position]))
        own = sample.prompt_logprobs[position]
        assert top[0][1] >= own - 1e-5
        listed = dict(top)
        if prompt[position] in listed:
            assert listed[prompt[position]] == pytest.approx(own, abs=1e-5)
        else:
            assert own <= top[-1][1] + 1e-5


def test_prompt_top_k_in_a_stream_equals_the_sample(native: tinkerrpc.Model) -> None:
    options = tinkerrpc.SamplingOptions(max_tokens=4, seed=3, prompt_top_logprobs=3, top_logprobs=2)
    with native.sample_stream(PROMPT, options) as stream:
        *_, last = list(stream)
    (unary,) = native.sample(PROMPT, options=options)
    assert last.samples is not None
    (streamed,) = last.samples
    assert streamed.tokens == unary.tokens
    assert len(streamed.prompt_top_logprobs) == len(unary.prompt_token_ids)
    for ours, theirs in zip(streamed.prompt_top_logprobs, unary.prompt_top_logprobs, strict=True):
        _same_top(_pairs(ours), _pairs(theirs))
    # Without the option, nothing about the prompt comes back.
    (plain,) = native.sample(PROMPT, max_tokens=1, seed=3)
    assert plain.prompt_top_logprobs == () and plain.prompt_logprobs == ()


@pytest.mark.parametrize("k", [-1, MAX_TOP_LOGPROBS + 1])
def test_prompt_top_logprobs_out_of_range_is_invalid_argument(
    server: Server, native: tinkerrpc.Model, k: int
) -> None:
    request = pb.SampleRequest(
        model="topk-native", text=PROMPT, params=types_pb2.SamplingParams(max_tokens=1, prompt_top_logprobs=k)
    )
    with pytest.raises(grpc.RpcError) as caught:
        server.stub.Sample(request, timeout=CALL_TIMEOUT)
    assert caught.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert "params.prompt_top_logprobs" in violated_fields(caught.value)
    assert f"[0, {MAX_TOP_LOGPROBS}]" in (caught.value.details() or "")
