"""Hostile campaign, second table set (issue 40): requests that arrive together and may be coalesced under
mixed options, the run view's event-stream parameters, sample keys after a restore or a delete, and every
RPC right after the backend finished serve's Tinker session. Each row has its exact expected answer. The
HTTP and key rows run on the hardening suite's hosted server (conftest.hosted_server: --max-sample-n 8,
--max-sample-tokens 64); the session rows on a serve over a separately started engine whose key the test
holds (tests/service/session_support.py). The HTTP row machinery is hardening_support's."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from hardening_support import (
    BIG_TOKEN,
    CHAT,
    COMPLETIONS,
    GENERATE,
    HI,
    MAX_SAMPLE_N,
    MAX_SAMPLE_TOKENS,
    SIDECAR_KEY,
    HostedServer,
    HttpRow,
    http_outcome,
)
from service.session_support import SESSION_TIMEOUT, finish_session, sessions, until_served
from service.svc import CALL_TIMEOUT, Server, create_model, poll_until, user, yes_no_sft_request

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

TOGETHER = "campaign-together"
WATCHED = "campaign-watched"
INT64_MAX = 2**63 - 1


@pytest.fixture(scope="module")
def hosted(hosted_server: HostedServer) -> HostedServer:
    stub = hosted_server.server.stub
    for name in (TOGETHER, WATCHED):
        create_model(stub, name)
    stub.Train(yes_no_sft_request(WATCHED, 1e-2), timeout=CALL_TIMEOUT)
    return hosted_server


# ---- requests that arrive together (the sidecar may draw identical ones as one Sample call)


@dataclass(frozen=True)
class Answer:
    status: int
    choices: int = 0  # a 200's number of choices
    needle: str = ""  # an error's message and "[param ...]" contain it


@dataclass(frozen=True)
class TogetherRow:
    label: str
    path: str
    bodies: tuple[dict[str, Any], ...]
    answers: tuple[Answer, ...]


def _chat(n: int = 1, **fields: Any) -> dict[str, Any]:
    return {"model": TOGETHER, "messages": HI, "max_tokens": 2, "n": n, **fields}


def _completion(n: int = 1, **fields: Any) -> dict[str, Any]:
    return {"model": TOGETHER, "prompt": "hello", "max_tokens": 2, "n": n, **fields}


def _generate(n: int = 1, **sampling: Any) -> dict[str, Any]:
    return {"model": TOGETHER, "token_ids": [1, 2], "sampling_params": {"max_tokens": 2, "n": n, **sampling}}


OK1, OK2, OK3, OK4, OK5, OK8 = (Answer(200, n) for n in (1, 2, 3, 4, 5, 8))
OVER_N = MAX_SAMPLE_N + 1
TOO_MANY = Answer(400, needle="--max-sample-n")


def together_rows() -> list[TogetherRow]:
    return [
        # One member over --max-sample-n: its own 400, the others their samples (issue 40 item 3)
        TogetherRow("chat: n over the limit among two n=1", CHAT, (_chat(OVER_N), _chat(), _chat()), (TOO_MANY, OK1, OK1)),
        TogetherRow("chat: the n=1 members first", CHAT, (_chat(), _chat(), _chat(OVER_N)), (OK1, OK1, TOO_MANY)),
        TogetherRow("generate: n over the limit among two n=1", GENERATE, (_generate(OVER_N), _generate(), _generate()), (TOO_MANY, OK1, OK1)),
        TogetherRow("completions: n over the limit among two n=1", COMPLETIONS, (_completion(OVER_N), _completion(), _completion()), (TOO_MANY, OK1, OK1)),
        TogetherRow("chat: two over the limit, one fine", CHAT, (_chat(OVER_N), _chat(OVER_N + 1), _chat(2)), (TOO_MANY, TOO_MANY, OK2)),
        TogetherRow("chat: each within the limit, their sum over it", CHAT, (_chat(4), _chat(4), _chat()), (OK4, OK4, OK1)),
        TogetherRow("generate: each within the limit, their sum over it", GENERATE, (_generate(5), _generate(5)), (OK5, OK5)),
        TogetherRow("completions: each within the limit, their sum over it", COMPLETIONS, (_completion(3), _completion(3), _completion(3)), (OK3, OK3, OK3)),
        TogetherRow("chat: the limit exactly, and one more", CHAT, (_chat(MAX_SAMPLE_N), _chat()), (OK8, OK1)),
        # Mixed options: never one call, each its own answer
        TogetherRow("chat: other temperature over the limit", CHAT, (_chat(temperature=0.5), _chat(OVER_N, temperature=1.0)), (OK1, TOO_MANY)),
        TogetherRow("chat: one over the token limit", CHAT, (_chat(max_tokens=MAX_SAMPLE_TOKENS + 1), _chat(), _chat()), (Answer(400, needle="--max-sample-tokens"), OK1, OK1)),
        TogetherRow("chat: one refused by the sidecar", CHAT, (_chat(top_p=0), _chat(), _chat()), (Answer(400, needle="[param top_p]"), OK1, OK1)),
        TogetherRow("chat: seeded over the limit, unseeded fine", CHAT, (_chat(OVER_N, seed=3), _chat(), _chat(seed=3)), (TOO_MANY, OK1, OK1)),
        TogetherRow("chat: other stop strings", CHAT, (_chat(OVER_N, stop=["x"]), _chat(stop=["y"]), _chat()), (TOO_MANY, OK1, OK1)),
        TogetherRow("chat: logprobs asked, one over the limit", CHAT, (_chat(2, logprobs=True, top_logprobs=2), _chat(OVER_N, logprobs=True, top_logprobs=2)), (OK2, TOO_MANY)),
        TogetherRow("generate: one foreign token", GENERATE, ({**_generate(), "token_ids": [1, BIG_TOKEN]}, _generate(), _generate()), (Answer(400, needle="outside the vocabulary"), OK1, OK1)),
        TogetherRow("chat: an unknown version for all", CHAT, (_chat(model=f"{TOGETHER}@42"), _chat(model=f"{TOGETHER}@42")), (Answer(404, needle="42"), Answer(404, needle="42"))),
        TogetherRow("chat: an unknown version and the live one", CHAT, (_chat(model=f"{TOGETHER}@42"), _chat(), _chat(model=f"{TOGETHER}@0")), (Answer(404, needle="42"), OK1, OK1)),
    ]  # fmt: skip


async def _together(sidecar: str, row: TogetherRow) -> list[Answer]:
    headers = {"authorization": f"Bearer {SIDECAR_KEY}"}
    async with httpx.AsyncClient(base_url=sidecar, headers=headers, timeout=CALL_TIMEOUT) as http:
        responses = await asyncio.gather(*(http.post(row.path, json=body) for body in row.bodies))
    answers = []
    for response in responses:
        body = response.json()
        if response.status_code == 200:
            answers.append(Answer(200, len(body["choices"])))
        else:
            error = body.get("error") or {}
            answers.append(
                Answer(response.status_code, needle=f"{error.get('message')} [param {error.get('param')}]")
            )
    return answers


def _matches(got: Answer, expected: Answer) -> bool:
    if got.status != expected.status:
        return False
    return got.choices == expected.choices if expected.status == 200 else expected.needle in got.needle


def test_requests_that_arrive_together_each_get_their_own_answer(hosted: HostedServer) -> None:
    failures = []
    rows = together_rows()
    # Each row three times: whether members share a call depends on their arrival, never their answers.
    for _round in range(3):
        for row in rows:
            got = asyncio.run(_together(hosted.sidecar_url, row))
            if len(got) != len(row.answers) or not all(map(_matches, got, row.answers)):
                failures.append(f"{row.label}: expected {row.answers}, got {got}")
    print(f"\ntogether rows: {len(rows)}, 3 rounds")
    assert not failures, "\n".join(failures)
    assert len(rows) >= 18


# ---- the run view's parameters (its event stream resumes from a version)


@dataclass(frozen=True)
class StreamRow:
    """A GET of the event stream with a Last-Event-ID header, or one that opens (200): the first table's
    HttpRow sends neither a header of the row's own nor reads a stream."""

    label: str
    query: str  # appended to /runs/{model}/events
    last_event_id: bytes | None
    status: int
    param: str | None  # the field a 400 names (OpenAI error shape)


def _events(query: str, model: str = WATCHED) -> str:
    return f"/runs/{model}/events{query}"


def run_view_http_rows() -> list[HttpRow]:
    """Plain requests of the run view: test_bad_input_campaign's rows and outcome."""
    huge = "9" * 5000
    return [
        HttpRow("from_version past int()'s 4300 digits", _events(f"?from_version={huge}"), None, 400, "[param from_version]", method="GET"),
        HttpRow("from_version past int64", _events(f"?from_version={INT64_MAX + 1}"), None, 400, "[param from_version]", method="GET"),
        HttpRow("from_version negative", _events("?from_version=-1"), None, 400, "from_version must be a policy version", method="GET"),
        HttpRow("from_version a fraction", _events("?from_version=1.5"), None, 400, "'1.5' [param from_version]", method="GET"),
        HttpRow("from_version empty", _events("?from_version="), None, 400, "[param from_version]", method="GET"),
        HttpRow("from_version a word", _events("?from_version=latest"), None, 400, "'latest' [param from_version]", method="GET"),
        HttpRow("events without the key", _events("?from_version=x"), None, 401, "API key", key=None, method="GET"),
        HttpRow("events with a wrong key", _events("?from_version=0"), None, 401, "API key", key="sk-wrong", method="GET"),
        HttpRow("state: steps not a boolean", f"/runs/{WATCHED}/state?steps=maybe", None, 400, "[param steps]", method="GET"),
        HttpRow("state: steps empty", f"/runs/{WATCHED}/state?steps=", None, 400, "steps must be true or false, not '' [param steps]", method="GET"),
        HttpRow("state: steps=0", f"/runs/{WATCHED}/state?steps=0", None, 200, "", method="GET"),
        HttpRow("state: an unknown model", "/runs/ghost/state", None, 404, "no model named 'ghost'", method="GET"),
    ]  # fmt: skip


def stream_rows() -> list[StreamRow]:
    huge = "9" * 5000
    return [
        StreamRow("Last-Event-ID past int()'s 4300 digits", "", huge.encode(), 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID past int64", "", str(INT64_MAX + 1).encode(), 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID at int64: the next is past it", "", str(INT64_MAX).encode(), 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID negative", "", b"-1", 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID not a number", "", b"seven", 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID a superscript digit", "", "\u00b2".encode("latin-1"), 400, "Last-Event-ID"),
        StreamRow("Last-Event-ID bad, from_version fine", "?from_version=0", b"1.0", 400, "Last-Event-ID"),
        StreamRow("from_version bad, Last-Event-ID fine", "?from_version=x", b"3", 400, "from_version"),
        StreamRow("from_version at int64", f"?from_version={INT64_MAX}", None, 200, None),
        StreamRow("Last-Event-ID one below int64", "", str(INT64_MAX - 1).encode(), 200, None),
        StreamRow("from_version 0 replays the run", "?from_version=0", None, 200, None),
    ]  # fmt: skip


def _stream_outcome(sidecar: str, row: StreamRow) -> tuple[int, str | None, str]:
    """Status, and the error's param and message, or for a 200 the stream's first line."""
    headers = [(b"authorization", f"Bearer {SIDECAR_KEY}".encode())]
    if row.last_event_id is not None:
        headers.append((b"last-event-id", row.last_event_id))  # bytes: sent as they are
    with (
        httpx.Client(timeout=CALL_TIMEOUT) as http,
        http.stream("GET", sidecar + _events(row.query), headers=headers) as response,
    ):
        if response.status_code == 200 and response.headers["content-type"].startswith("text/event-stream"):
            return 200, None, next(response.iter_lines())
        error = json.loads(response.read()).get("error") or {}
        return response.status_code, error.get("param"), str(error.get("message"))


def test_the_run_views_parameters_are_checked(hosted: HostedServer) -> None:
    failures = []
    plain = run_view_http_rows()
    for row in plain:
        status, message = http_outcome(hosted.sidecar_url, row)
        if status != row.status or row.needle.lower() not in message.lower():
            failures.append(
                f"{row.label}: expected {row.status} with {row.needle!r}, got {status}: {message[:200]}"
            )
    streams = stream_rows()
    for stream_row in streams:
        status, param, message = _stream_outcome(hosted.sidecar_url, stream_row)
        if status != stream_row.status:
            failures.append(
                f"{stream_row.label}: expected {stream_row.status}, got {status}: {message[:200]}"
            )
        elif status == 400 and (param != stream_row.param or not message.startswith(f"{param} must be ")):
            failures.append(
                f"{stream_row.label}: expected [param {stream_row.param}], got [param {param}]: {message[:200]}"
            )
        elif status == 200 and message != ": watching":
            failures.append(f"{stream_row.label}: the stream opened with {message!r}")
    print(f"\nrun view rows: {len(plain)} + {len(streams)}")
    assert not failures, "\n".join(failures)
    assert len(plain) + len(streams) >= 21


# ---- sample keys after a restore or a delete


@dataclass(frozen=True)
class KeyRow:
    label: str
    request: pb.TrainRequest
    scored: int  # the tokens Train scores: those of every turn whose key it does not honour


@dataclass(frozen=True)
class Keyed:
    """One sampled sequence as a turn names it: its tokens, version and key."""

    prompt: list[int]
    tokens: list[int]
    version: int
    key: str


def _sample(stub: Any, model: str, version: int | None = None) -> list[Keyed]:
    request = pb.SampleRequest(
        model=model,
        chat=pb.ChatPrompt(messages=[user("respond with yes")]),
        params=types_pb2.SamplingParams(n=2, max_tokens=4),
    )
    if version is not None:
        request.policy_version = version
    sampled = stub.Sample(request, timeout=CALL_TIMEOUT)
    keyed = [
        Keyed(list(sampled.prompt_token_ids), list(s.token_ids), s.policy_version, s.sample_key)
        for s in sampled.sequences
    ]
    assert all(k.key and k.tokens for k in keyed)
    return keyed


def _keyed_train(model: str, first: Keyed, second: Keyed, **turn_changes: Any) -> pb.TrainRequest:
    """Two trajectories (rewards 1 and 0) of one turn each, without logprobs: each names its key."""
    request = pb.TrainRequest(model=model, adam=types_pb2.AdamParams(learning_rate=1e-3))
    group = request.groups.add()
    for reward, keyed in ((1.0, first), (0.0, second)):
        turn = group.trajectories.add(reward=reward).turns.add(
            prompt_token_ids=keyed.prompt,
            completion_token_ids=keyed.tokens,
            policy_version=keyed.version,
            sample_key=keyed.key,
        )
        for name, value in turn_changes.items():
            setattr(turn, name, value)
    return request


def key_rows(stub: Any) -> list[KeyRow]:
    """The history the rows name: model KEYS trained to version 2, restored to 1 and trained to a new
    version 2; model GONE deleted and created again under its name."""
    keys, gone = "campaign-keys", "campaign-gone"
    create_model(stub, keys)
    at_zero = _sample(stub, keys)
    stub.Train(_keyed_train(keys, *at_zero), timeout=CALL_TIMEOUT)
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=keys, name="one"), timeout=CALL_TIMEOUT)
    at_one = _sample(stub, keys)
    stub.Train(_keyed_train(keys, *at_one), timeout=CALL_TIMEOUT)
    discarded = _sample(stub, keys)
    assert discarded[0].version == 2
    stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(model=keys, checkpoint="one"), timeout=CALL_TIMEOUT)
    stub.Train(yes_no_sft_request(keys, 1e-2), timeout=CALL_TIMEOUT)
    again = _sample(stub, keys)
    assert again[0].version == 2

    create_model(stub, gone)
    deleted = _sample(stub, gone)
    stub.DeleteModel(pb.DeleteModelRequest(name=gone), timeout=CALL_TIMEOUT)
    create_model(stub, gone)
    recreated = _sample(stub, gone)

    def tokens(*keyed: Keyed) -> int:
        return sum(len(k.tokens) for k in keyed)

    tampered = Keyed(again[0].prompt, again[0].tokens, 2, again[0].key[:-4] + "0000")
    swapped = Keyed(again[1].prompt, again[1].tokens, 2, again[0].key)
    nonce_only = Keyed(again[0].prompt, again[0].tokens, 2, "." + again[0].key.partition(".")[2])
    return [
        KeyRow("restore: the discarded version 2's keys", _keyed_train(keys, *discarded), tokens(*discarded)),
        KeyRow("restore: the new version 2's keys", _keyed_train(keys, *again), 0),
        KeyRow("restore: one discarded, one live", _keyed_train(keys, discarded[0], again[1]), tokens(discarded[0])),
        KeyRow("restore: the restored version's own keys", _keyed_train(keys, *at_one), tokens(*at_one)),
        KeyRow("restore: a version before the restored one", _keyed_train(keys, *at_zero), 0),
        KeyRow("delete: the deleted model's keys on the new one", _keyed_train(gone, *deleted), tokens(*deleted)),
        KeyRow("delete: the new model's own keys", _keyed_train(gone, *recreated), 0),
        KeyRow("another model's keys", _keyed_train(gone, *at_zero), tokens(*at_zero)),
        KeyRow("a tampered key", _keyed_train(keys, tampered, again[1]), tokens(tampered)),
        KeyRow("a key of the other sequence", _keyed_train(keys, swapped, again[0]), tokens(swapped)),
        KeyRow("a key without its nonce", _keyed_train(keys, nonce_only, again[1]), tokens(nonce_only)),
        KeyRow("a key named at another version", _keyed_train(keys, *at_zero, policy_version=1), tokens(*at_zero)),
    ]  # fmt: skip


def test_sample_keys_of_discarded_versions_are_scored(hosted: HostedServer) -> None:
    stub = hosted.server.stub
    failures = []
    rows = key_rows(stub)
    for row in rows:
        try:
            scored = stub.Train(row.request, timeout=CALL_TIMEOUT).metrics.scored_tokens
        except grpc.RpcError as err:
            failures.append(f"{row.label}: {err.code()}: {err.details()}")
            continue
        if scored != row.scored:
            failures.append(f"{row.label}: expected {row.scored} scored tokens, got {scored}")
    print(f"\nsample key rows: {len(rows)}")
    assert not failures, "\n".join(failures)
    assert len(rows) >= 12


# ---- every RPC right after the backend finished serve's session


SESSION_MODEL = "campaign-session"
OTHER = "campaign-session-other"


@dataclass(frozen=True)
class SessionRow:
    label: str
    call: Callable[[Any], Any]  # on the stub, right after the session was finished
    answer: Callable[[Any], Any]  # what of the response is compared
    expected: Any


def session_rows() -> list[SessionRow]:
    """In order, from SESSION_MODEL at version 1 with state checkpoint "one" (version 1)."""
    sample_n3 = types_pb2.SamplingParams(n=3, max_tokens=2)
    chat = pb.ChatPrompt(messages=[user("hello")])
    return [
        SessionRow("GetModel", lambda s: s.GetModel(pb.GetModelRequest(name=SESSION_MODEL), timeout=CALL_TIMEOUT), lambda r: r.model.policy_version, 1),
        SessionRow("Sample", lambda s: s.Sample(pb.SampleRequest(model=SESSION_MODEL, chat=chat, params=sample_n3), timeout=CALL_TIMEOUT), lambda r: (len(r.sequences), r.policy_version), (3, 1)),
        SessionRow("Train", lambda s: s.Train(yes_no_sft_request(SESSION_MODEL, 1e-2), timeout=CALL_TIMEOUT), lambda r: r.policy_version, 2),
        SessionRow("Sample, pinned to version 1", lambda s: s.Sample(pb.SampleRequest(model=SESSION_MODEL, chat=chat, params=sample_n3, policy_version=1), timeout=CALL_TIMEOUT), lambda r: r.policy_version, 1),
        SessionRow("SaveCheckpoint", lambda s: s.SaveCheckpoint(pb.SaveCheckpointRequest(model=SESSION_MODEL, name="two"), timeout=CALL_TIMEOUT), lambda r: (r.checkpoint.name, r.checkpoint.policy_version), ("two", 2)),
        SessionRow("RestoreCheckpoint", lambda s: s.RestoreCheckpoint(pb.RestoreCheckpointRequest(model=SESSION_MODEL, checkpoint="one"), timeout=CALL_TIMEOUT), lambda r: r.model.policy_version, 1),
        SessionRow("Train after the restore", lambda s: s.Train(yes_no_sft_request(SESSION_MODEL, 1e-2), timeout=CALL_TIMEOUT), lambda r: r.policy_version, 2),
        SessionRow("CreateModel", lambda s: s.CreateModel(pb.CreateModelRequest(name=OTHER, base_model="tinkerrpc/tiny-chat", lora=types_pb2.LoraConfig(rank=8)), timeout=CALL_TIMEOUT), lambda r: r.model.policy_version, 0),
        SessionRow("Train the new model", lambda s: s.Train(yes_no_sft_request(OTHER, 1e-2), timeout=CALL_TIMEOUT), lambda r: r.policy_version, 1),
        SessionRow("ListModels", lambda s: s.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT), lambda r: sorted(m.name for m in r.models), sorted([SESSION_MODEL, OTHER])),
        SessionRow("ListCheckpoints", lambda s: s.ListCheckpoints(pb.ListCheckpointsRequest(model=SESSION_MODEL), timeout=CALL_TIMEOUT), lambda r: sorted(c.name for c in r.checkpoints if not c.automatic), ["one", "two"]),
        SessionRow("GetRunHistory", lambda s: s.GetRunHistory(pb.GetRunHistoryRequest(model=SESSION_MODEL), timeout=CALL_TIMEOUT), lambda r: [step.policy_version for step in r.steps], [1, 2]),
        SessionRow("ExportWeights", lambda s: list(s.ExportWeights(pb.ExportWeightsRequest(model=SESSION_MODEL), timeout=CALL_TIMEOUT)), lambda r: r[0].weights.policy_version, 2),
        SessionRow("ExportWeights of version 1", lambda s: list(s.ExportWeights(pb.ExportWeightsRequest(model=SESSION_MODEL, policy_version=1), timeout=CALL_TIMEOUT)), lambda r: r[0].weights.policy_version, 1),
        SessionRow("DeleteModel", lambda s: s.DeleteModel(pb.DeleteModelRequest(name=OTHER), timeout=CALL_TIMEOUT), lambda r: r, pb.DeleteModelResponse()),
        SessionRow("GetModel at the end", lambda s: s.GetModel(pb.GetModelRequest(name=SESSION_MODEL), timeout=CALL_TIMEOUT), lambda r: r.model.policy_version, 2),
    ]  # fmt: skip


@pytest.fixture(scope="module")
def engine_and_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalEngine, Server]]:
    tmp = tmp_path_factory.mktemp("campaign-sessions")
    models = tmp / "models"
    with LocalEngine(tmp / "engine", models, tmp / "engine.log", 240, SESSION_TIMEOUT) as engine:
        env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
        server = Server(tmp / "data", models, tmp / "serve.log", env, "--tinker-url", engine.base_url)
        try:
            yield engine, server
        finally:
            assert server.close() == 0, server.proc.log()[-3000:]


def _engine_live_models(engine: LocalEngine) -> int:
    return engine.stats()["live_models"]


def test_every_rpc_right_after_the_session_ends_is_served_or_unavailable(
    engine_and_server: tuple[LocalEngine, Server],
) -> None:
    engine, server = engine_and_server
    stub = server.stub
    create_model(stub, SESSION_MODEL)
    stub.Train(yes_no_sft_request(SESSION_MODEL, 1e-2), timeout=CALL_TIMEOUT)
    stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=SESSION_MODEL, name="one"), timeout=CALL_TIMEOUT)
    failures = []
    rows = session_rows()
    retried = 0
    for row in rows:
        finish_session(engine, sessions(engine)[-1])
        try:
            response, failed = until_served(lambda row=row: row.call(stub), row.label)  # type: ignore[misc]
        except AssertionError as err:
            failures.append(f"{row.label}: {err}")
            continue
        retried += failed
        if row.answer(response) != row.expected:
            failures.append(f"{row.label}: expected {row.expected}, got {row.answer(response)}")
    print(f"\nsession rows: {len(rows)}; {retried} UNAVAILABLE answers before they were served")
    assert not failures, "\n".join(failures)
    assert len(rows) >= 16
    health = health_pb2_grpc.HealthStub(server.channel)
    assert poll_until(
        lambda: (
            health.Check(health_pb2.HealthCheckRequest(), timeout=10).status
            == health_pb2.HealthCheckResponse.SERVING
        ),
        30,
    )
    # Nothing was made in a finished session and left behind: once the last session is finished too (its
    # training clients unloaded with it) and serve has opened a new one, the engine holds no model.
    opened = len(sessions(engine))
    finish_session(engine, sessions(engine)[-1])
    assert poll_until(lambda: len(sessions(engine)) > opened, 30), "serve opens a new session by itself"
    assert poll_until(lambda: _engine_live_models(engine) == 0, 30), engine.stats()
