"""Streams through the sidecar send each token when it is made (through the SampleStream RPC), with the
real openai client on tiny-chat: the first content chunk comes early in the call and the chunks are
spread over it; a client that leaves frees its rows in the engine; a stop string never shows in pieces;
chat, completions and Responses streams join to their plain answers; a chat stream's chunks carry the
policy spans of their tokens, which join to the plain choice's; `/inference/v1/generate` streams its
tokens as vLLM frames them."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from sidecar_support import API_KEY, Sidecar, start_sidecar

import tinkerrpc
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.sidecar.sample_streams import ChoiceContent, markup_start

pytestmark = pytest.mark.process

MODEL = "streamer"
USER = [{"role": "user", "content": "Tell me a story."}]


class Served:
    def __init__(self, server: LocalStack, sidecar: Sidecar) -> None:
        self.server = server
        self.sidecar = sidecar
        self.api = openai.OpenAI(base_url=sidecar.openai_base_url, api_key=API_KEY, max_retries=0)


@pytest.fixture(scope="module")
def served(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Served]:
    work = tmp_path_factory.mktemp("streaming")
    with LocalStack(work / "data", work / "serve.log", startup_timeout=180) as server:
        sidecar = start_sidecar(server.target, work / "sidecar.log")
        with tinkerrpc.Client(server.target) as client:
            client.create_model(MODEL, base_model="tinkerrpc/tiny-chat", lora_rank=8)
        yield Served(server, sidecar)
        assert sidecar.stop() == 0, sidecar.log()[-2000:]


def _timed(stream: Any) -> list[tuple[float, Any]]:
    return [(time.perf_counter(), chunk) for chunk in stream]


def test_chat_tokens_arrive_as_they_are_made(served: Served) -> None:
    """The first content chunk of a 128-token completion comes before 30% of the call, and the token
    chunks are spread over it (measured within the same call, so a loaded machine slows both ends)."""
    request: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 128, "logprobs": True}
    extra = {"ignore_eos": True}
    # The random model's reply opens with plain text for this seed (a reply opening with a tag is held
    # until it is parsed, by design): the timing is about the stream, not the model's words.
    for seed in range(64):
        plain = served.api.chat.completions.create(**request, seed=seed, extra_body=extra)
        content = plain.choices[0].message.content or ""
        if len(content) > 8 and markup_start(content[:8]) is None:
            break
    started = time.perf_counter()
    timed = _timed(served.api.chat.completions.create(**request, seed=seed, stream=True, extra_body=extra))
    total = time.perf_counter() - started
    token_chunks = [
        (t - started, ids)
        for t, c in timed
        if c.choices and (ids := (c.choices[0].delta.model_extra or {}).get("token_ids"))
    ]
    token_times = [t for t, _ in token_chunks]
    content_times = [t - started for t, c in timed if c.choices and c.choices[0].delta.content]
    # Every token is sent; a reader that lags (a loaded machine) may get a few in one chunk.
    assert sum(len(ids) for _, ids in token_chunks) == 128
    assert len(token_chunks) >= 64
    assert content_times[0] < 0.3 * total, (content_times[0], total)
    # Spread: the tokens' arrivals span most of the call, not a burst at its end.
    assert token_times[-1] - token_times[0] > 0.5 * total, (token_times[0], token_times[-1], total)
    assert token_times[len(token_times) // 2] < 0.8 * total
    streamed = "".join(c.choices[0].delta.content or "" for _, c in timed if c.choices)
    assert streamed == content


def test_completions_and_responses_streams_join_to_their_plain_answers(served: Served) -> None:
    request: dict[str, Any] = {
        "model": MODEL,
        "prompt": "Once upon a time",
        "max_tokens": 24,
        "seed": 8,
        "n": 2,
    }
    chunks = list(served.api.completions.create(**request, stream=True, logprobs=1))
    plain = served.api.completions.create(**request, logprobs=1)
    for choice in plain.choices:
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == choice.index]
        assert "".join(c.text for c in mine) == choice.text
        assert [lp for c in mine if c.logprobs for lp in c.logprobs.token_logprobs or []] == (
            choice.logprobs.token_logprobs if choice.logprobs else None
        )
    response_request: dict[str, Any] = {"model": MODEL, "input": "Hi", "max_output_tokens": 24}
    events = list(served.api.responses.create(**response_request, stream=True, extra_body={"seed": 4}))
    final = served.api.responses.create(**response_request, extra_body={"seed": 4})
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == final.output_text
    assert events[-1].type in ("response.completed", "response.incomplete")


def test_a_stop_string_never_shows_in_pieces(served: Served) -> None:
    greedy: dict[str, Any] = {
        "model": MODEL,
        "prompt": "The end",
        "max_tokens": 40,
        "temperature": 0,
        "logprobs": 0,
    }
    plain = served.api.completions.create(**greedy, extra_body={"ignore_eos": True})
    assert plain.choices[0].logprobs is not None
    tokens = plain.choices[0].logprobs.tokens or []
    ends = [len("".join(tokens[: i + 1])) for i in range(len(tokens))]
    text = plain.choices[0].text
    stop = next(
        text[end - 2 : end + 2]
        for end in ends[3:-3]
        if "\ufffd" not in text[end - 2 : end + 2] and text.find(text[end - 2 : end + 2]) == end - 2
    )
    stopped = {**greedy, "stop": [stop]}
    chunks = list(served.api.completions.create(**stopped, stream=True, extra_body={"ignore_eos": True}))
    streamed = "".join(c.choices[0].text for c in chunks if c.choices)
    assert streamed == text[: text.find(stop)]
    assert chunks[-1].choices[0].finish_reason == "stop"


def test_a_client_that_leaves_frees_its_rows(served: Served) -> None:
    """A client that leaves after the first chunk makes the engine drop its rows. On a loaded machine the
    engine may finish a request before the client's leaving reaches it, so each try asks for more rows."""
    headers = {"Authorization": f"Bearer {API_KEY}"}
    for rows in (1, 4, 16):
        log_before = served.server.log().count("its reader left")
        body = {"model": MODEL, "prompt": [5, 6, 7], "max_tokens": 2000, "n": rows, "stream": True}
        body["ignore_eos"] = True
        with httpx.stream(
            "POST", f"{served.sidecar.openai_base_url}/completions", json=body, headers=headers, timeout=60
        ) as answer:
            lines = answer.iter_lines()
            assert next(line for line in lines if line.startswith("data:"))
        deadline = time.monotonic() + 20
        while served.server.log().count("its reader left") == log_before and time.monotonic() < deadline:
            time.sleep(0.1)
        if served.server.log().count("its reader left") > log_before:
            return
    raise AssertionError("the engine kept decoding for nobody")


def test_markup_holds_chat_content_until_parsed() -> None:
    assert markup_start("a < b and <3") is None
    assert markup_start("hello <tool") == len("hello ")
    assert markup_start("x<think>y") == 1
    content = ChoiceContent(chat=True)
    pieces = (b"Hi <to", b"ol_call>", b"{")
    delta = tinkerrpc.SampleDelta(
        index=0, tokens=(1, 2, 3), logprobs=(-1.0,) * 3, text="", token_bytes=pieces
    )
    assert content.take(delta) == "Hi "
    # A stop string's start waits; a character's bytes split over tokens come out whole.
    stopping = ChoiceContent(chat=True, stops=["END"])
    split = tinkerrpc.SampleDelta(
        index=0, tokens=(1, 2), logprobs=(-1.0,) * 2, text="", token_bytes=(b"caf\xc3", b"\xa9 E")
    )
    assert stopping.take(split) == "café "
    assert content.finish("Hi ") == ""
    assert content.finish("Hi there") == "there"


def _span_identity(span: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in span.items() if k not in ("start_token", "end_token")}


def test_chat_stream_chunks_carry_the_policy_spans_of_their_tokens(served: Served) -> None:
    """Each chunk with tokens carries them on its choice with the span of the choice's tokens they fill;
    joined as ART's stream reader joins them (adjacent spans of one identity merge), the spans and token
    ids are the plain choice's, and each choice's first chunk carries the plain choice's prompt spans."""
    request: dict[str, Any] = {"model": MODEL, "messages": USER, "max_tokens": 16, "n": 2, "seed": 11}
    rl = {"return_token_ids": True}
    plain = served.api.chat.completions.create(**request, extra_body=rl)
    prompt = (plain.model_extra or {})["prompt_token_ids"]
    chunks = list(served.api.chat.completions.create(**request, stream=True, extra_body=rl))
    for choice in plain.choices:
        expected = choice.model_extra or {}
        (whole,) = expected["policy_token_spans"]
        assert whole == {
            "start_token": 0,
            "end_token": len(expected["token_ids"]),
            "generation_id": f"{MODEL}@0",
            "policy_version": 0,
            "lora_slot": f"{MODEL}@0",
            "update_seq": 0,
        }
        assert expected["prompt_policy_token_spans"] == [
            {**whole, "start_token": 1, "end_token": len(prompt)}
        ]
        pieces = [
            c.choices[0].model_extra or {} for c in chunks if c.choices and c.choices[0].index == choice.index
        ]
        assert pieces[0]["prompt_policy_token_spans"] == expected["prompt_policy_token_spans"]
        token_ids: list[int] = []
        joined: list[dict[str, Any]] = []
        for piece in (p for p in pieces if "policy_token_spans" in p):
            (span,) = piece["policy_token_spans"]
            assert span["start_token"] == len(token_ids) and piece["token_ids"]
            token_ids += piece["token_ids"]
            assert span["end_token"] == len(token_ids)
            if joined and _span_identity(joined[-1]) == _span_identity(span):
                joined[-1]["end_token"] = span["end_token"]
            else:
                joined.append(dict(span))
        assert token_ids == expected["token_ids"]
        assert joined == expected["policy_token_spans"]
    # A stream that asks for no RL field stays OpenAI-shaped.
    bare = list(served.api.chat.completions.create(**request, stream=True))
    assert not any(
        {"token_ids", "policy_token_spans", "prompt_policy_token_spans"} & set(c.choices[0].model_extra or {})
        for c in bare
        if c.choices
    )


GENERATE = "/inference/v1/generate"
HEADERS = {"Authorization": f"Bearer {API_KEY}"}


def _generate_frames(served: Served, body: dict[str, Any]) -> list[tuple[float, str]]:
    """The `data:` payloads of a generate stream, each with its arrival time."""
    url = f"{served.sidecar.base_url}{GENERATE}"
    with httpx.stream("POST", url, json=body, headers=HEADERS, timeout=120) as answer:
        assert answer.status_code == 200, answer.read()
        assert answer.headers["content-type"].startswith("text/event-stream")
        return [
            (time.perf_counter(), line[len("data: ") :])
            for line in answer.iter_lines()
            if line.startswith("data: ")
        ]


def test_generate_streams_tokens_in_vllms_frames(served: Served) -> None:
    """vLLM's generate stream: a GenerateStreamResponse per batch of new tokens, the finish_reason and the
    sample key on each choice's last, the usage as asked, then [DONE]; joined, the plain answer (same
    seed), and the streamed sample keys train with nothing scored."""
    client = tinkerrpc.Client(served.server.target)
    model = client.create_model("stream-generate", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    prompt = [5, 6, 7, 8]
    params = {"n": 2, "max_tokens": 12, "seed": 5, "temperature": 1.0, "logprobs": 1}
    body = {"model": "stream-generate", "token_ids": prompt, "sampling_params": params, "request_id": "r-s"}
    plain = httpx.post(f"{served.sidecar.base_url}{GENERATE}", json=body, headers=HEADERS, timeout=60).json()
    usage_options = {"include_usage": True, "continuous_usage_stats": True}
    frames = [
        data
        for _, data in _generate_frames(served, {**body, "stream": True, "stream_options": usage_options})
    ]
    assert frames[-1] == "[DONE]"
    chunks = [json.loads(data) for data in frames[:-1]]
    *token_chunks, usage_chunk = chunks
    # vLLM's frames: nulls kept on token chunks; the usage chunk has no choices and no nulls.
    assert usage_chunk == {"request_id": "r-s", "choices": [], "usage": plain["usage"], "policy_version": 0}
    assert token_chunks[0]["prompt_token_ids"] == prompt
    made = {0: 0, 1: 0}
    for chunk in token_chunks:
        assert set(chunk) == {"request_id", "choices", "usage", "prompt_token_ids", "policy_version"}
        assert chunk["request_id"] == "r-s" and chunk["policy_version"] == 0
        assert chunk is token_chunks[0] or chunk["prompt_token_ids"] is None
        (choice,) = chunk["choices"]
        expected_keys = {"index", "logprobs", "finish_reason", "token_ids", "policy_version", "sample_key"}
        assert set(choice) == expected_keys
        made[choice["index"]] += len(choice["token_ids"])
        assert chunk["usage"] == {
            "prompt_tokens": len(prompt),
            "completion_tokens": made[choice["index"]],
            "total_tokens": len(prompt) + made[choice["index"]],
        }
    turns = []
    for expected in plain["choices"]:
        mine = [c["choices"][0] for c in token_chunks if c["choices"][0]["index"] == expected["index"]]
        assert [c["finish_reason"] for c in mine] == [None] * (len(mine) - 1) + [expected["finish_reason"]]
        assert [c["sample_key"] is not None for c in mine] == [False] * (len(mine) - 1) + [True]
        assert [t for c in mine for t in c["token_ids"]] == expected["token_ids"]
        entries = [e for c in mine for e in c["logprobs"]["content"]]
        assert [e["token"] for e in entries] == [e["token"] for e in expected["logprobs"]["content"]]
        assert [e["logprob"] for e in entries] == pytest.approx(
            [e["logprob"] for e in expected["logprobs"]["content"]], abs=1e-5
        )
        turns.append(tinkerrpc.SampledTurn(prompt, expected["token_ids"], (), 0, mine[-1]["sample_key"]))
    group = tinkerrpc.TrajectoryGroup(
        [tinkerrpc.Trajectory(turns=[turn], reward=float(i)) for i, turn in enumerate(turns)]
    )
    result = model.train([group], learning_rate=1e-3)
    assert result.metrics.scored_tokens == 0 and result.metrics.trajectories_used == 2
    client.close()
    # Without logprobs or usage asked: null logprobs and usage on every chunk, and no usage chunk.
    frames = [
        data
        for _, data in _generate_frames(
            served, {**body, "sampling_params": {"max_tokens": 3}, "stream": True}
        )
    ]
    chunks = [json.loads(data) for data in frames[:-1]]
    assert all(c["usage"] is None and c["choices"][0]["logprobs"] is None for c in chunks)
    assert chunks[-1]["choices"][0]["finish_reason"] == "length" and chunks[-1]["policy_version"] == 1


def test_generate_stream_tokens_arrive_as_they_are_made(served: Served) -> None:
    """The first token chunk of a 128-token generation comes before 30% of the call, and the token
    chunks are spread over it (measured within the same call)."""
    params = {"max_tokens": 128, "ignore_eos": True, "seed": 2}
    body = {"model": MODEL, "token_ids": [5, 6, 7], "sampling_params": params, "stream": True}
    started = time.perf_counter()
    frames = _generate_frames(served, body)
    total = time.perf_counter() - started
    token_times = [t - started for t, data in frames[:-1]]
    assert sum(len(json.loads(data)["choices"][0]["token_ids"]) for _, data in frames[:-1]) == 128
    assert len(token_times) >= 64
    assert token_times[0] < 0.3 * total, (token_times[0], total)
    assert token_times[-1] - token_times[0] > 0.5 * total, (token_times[0], token_times[-1], total)


def test_generate_stream_refusals_come_before_the_stream(served: Served) -> None:
    """A request the server refuses is an ordinary OpenAI error naming this route's field, not a stream."""
    url = f"{served.sidecar.base_url}{GENERATE}"
    body = {"model": MODEL, "token_ids": [1, 10**6], "sampling_params": {"max_tokens": 2}, "stream": True}
    refused = httpx.post(url, json=body, headers=HEADERS, timeout=60)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "token_ids", refused.text
    missing = httpx.post(url, json={**body, "model": "ghost", "token_ids": [1]}, headers=HEADERS, timeout=60)
    assert missing.status_code == 404 and missing.json()["error"]["param"] == "model", missing.text
