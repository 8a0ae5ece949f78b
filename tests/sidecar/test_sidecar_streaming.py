"""Streams through the sidecar send each token when it is made (through the SampleStream RPC), with the
real openai client on tiny-chat: the first content chunk comes early in the call and the chunks are
spread over it; a client that leaves frees its rows in the engine; a stop string never shows in pieces;
chat, completions and Responses streams join to their plain answers."""

from __future__ import annotations

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
