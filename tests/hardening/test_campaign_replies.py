"""The campaign's reply rows (issue 40): what the server makes of hostile model output, each row with its
exact answer. Three tables, the campaigns' HTTP rows (hardening_support) for the refusals:

- parse rows: a reply as the model could write it (tool-call markup that is malformed or adversarial,
  several end-of-turn tokens, a cut at max_tokens) and the message the server parses from it, on
  tiny-chat's real codec;
- reply rows: chat requests to the hosted sidecar on a model taught to write such replies
  (reply_lessons.py), each answered alike plain and streamed;
- refusal rows: requests the sidecar refuses, with the status and the error's words.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import pytest
from hardening_support import CHAT, COMPLETIONS, HostedServer, HttpRow, http_outcome
from reply_client import both_replies
from reply_lessons import (
    ARGUMENTS,
    BAD_JSON,
    CALL_THEN_CHATTER,
    UNOFFERED,
    WEATHER,
    WEATHER_TOOL,
    YES,
    Lesson,
    question,
    taught_model,
    written,
)

from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs
from tinkerrpc_server.service.replies import parse_reply, tool_call_opening

pytestmark = pytest.mark.process

T = "<think>\n\n</think>\n\n"  # the empty think block tiny-chat's model writes first
END = "<|im_end|>"
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
PARIS = ("get_weather", {"city": "Paris"})


def call_of(arguments: str, name: str = "get_weather") -> str:
    return f'<tool_call>\n{{"name": "{name}", "arguments": {arguments}}}\n</tool_call>'


def raw(body: str) -> str:
    return f"<tool_call>\n{body}\n</tool_call>"


# ---- parse rows


@dataclass(frozen=True)
class ParseRow:
    label: str
    reply: str  # what the model writes, as text (tokenised with tiny-chat's tokenizer)
    content: str
    calls: tuple[tuple[str, Any], ...] = ()
    offered: frozenset[str] = frozenset({"get_weather"})
    forced: str | None = None  # a forced call: "" for any function, else its name


def bad(markup: str, before: str = T) -> ParseRow:
    """A row whose markup fails: the turn comes back as sampled, the end of turn left out."""
    return ParseRow("", before + markup + END, before + markup)


UNQUOTED = call_of('{"city": Paris}')
TRAILING_COMMA = call_of('{"city": "Paris",}')
STRING_ARGUMENTS = call_of(json.dumps(json.dumps(ARGUMENTS)))
NO_ARGUMENTS = raw('{"name": "get_weather"}')
NUMBER_NAME = raw('{"name": 7, "arguments": {}}')
EMPTY_NAME = call_of("{}", name="")
ARRAY_OF_CALLS = raw('[{"name": "get_weather", "arguments": {}}]')
NAN = call_of('{"city": NaN}')
MINUS_INFINITY = call_of('{"t": -Infinity}')
HUGE_NUMBER = call_of('{"n": ' + "1" * 5000 + "}")
TOO_DEEP = call_of('{"a": ' * 65 + "1" + "}" * 65)  # arguments of 65 levels
DEEPEST = '{"a": ' * 64 + "1" + "}" * 64  # 64 levels: within the bound
ROCKETS = call_of("{}", name="launch_rockets")
OTHER_CASE = call_of("{}", name="Get_Weather")
UNCLOSED_JSON = call_of("{")
RM = call_of("{}", name="rm")
CLOSING_TAG_INSIDE = call_of('{"city": "</tool_call>"}')
OPENING_TAG_INSIDE = call_of('{"city": "<tool_call>"}')
DUPLICATE_KEYS = call_of('{"city": "Paris", "city": "Lyon"}')
ESCAPED = call_of('{"city": "Par\\u00eds"}')
FORCED_OPENING = T + '<tool_call>\n{"name": "'


def labelled(label: str, row: ParseRow) -> ParseRow:
    return ParseRow(label, row.reply, row.content, row.calls, row.offered, row.forced)


PARSE_ROWS = [
    ParseRow("plain answer", T + "Hello" + END, "Hello"),
    ParseRow("a good call", T + CALL + END, "", (PARIS,)),
    labelled("unquoted string in the arguments", bad(UNQUOTED)),
    labelled("trailing comma", bad(TRAILING_COMMA)),
    labelled("arguments as a JSON string", bad(STRING_ARGUMENTS)),
    labelled("no arguments", bad(NO_ARGUMENTS)),
    labelled("a name that is a number", bad(NUMBER_NAME)),
    labelled("an empty name", bad(EMPTY_NAME)),
    labelled("a JSON array of calls", bad(ARRAY_OF_CALLS)),
    labelled("NaN in the arguments", bad(NAN)),
    labelled("-Infinity in the arguments", bad(MINUS_INFINITY)),
    labelled("a 5000-digit number in the arguments", bad(HUGE_NUMBER, before="")),
    labelled("arguments nested past the bound", bad(TOO_DEEP, before="")),
    ParseRow("arguments nested to the bound", call_of(DEEPEST) + END, "", (("get_weather", json.loads(DEEPEST)),)),
    labelled("a function not offered", bad(ROCKETS)),
    labelled("the offered name in other case", bad(OTHER_CASE)),
    ParseRow("any call when no tools are offered", T + CALL + END, T + CALL, offered=frozenset()),
    labelled("a good call beside a bad one", bad(CALL + "\n" + UNCLOSED_JSON, before="")),
    labelled("a good call beside one not offered", bad(CALL + RM, before="")),
    ParseRow("two good calls", T + CALL + "\n" + CALL + END, "\n", (PARIS, PARIS)),
    ParseRow("text around a call", T + "Let me check." + CALL + "Done." + END, "Let me check.Done.", (PARIS,)),
    ParseRow("a call, then chatter cut at max_tokens", T + CALL + "\nIt is usually mi", "\nIt is usually mi", (PARIS,)),
    ParseRow("a call cut open at max_tokens", T + CALL[:-6], T + CALL[:-6]),
    labelled("the closing tag inside an argument", bad(CLOSING_TAG_INSIDE, before="")),
    # Two openings and one closing: the renderer sees a block never closed.
    labelled("the opening tag inside an argument", bad(OPENING_TAG_INSIDE, before="")),
    ParseRow("the end of turn inside a call", '<tool_call>\n{"name": "get_' + END + 'weather"}', '<tool_call>\n{"name": "get_weather"}'),
    ParseRow("several end-of-turn tokens", T + "yes" + END + END + "\n<|im_start|>user\nno" + END + "yes", "yes\nuser\nnoyes"),
    ParseRow("a call past the end of turn", T + "yes" + END + CALL + END, "yes" + CALL),
    ParseRow("the end of turn first", END + T + "yes", T + "yes"),
    ParseRow("a control token inside the turn", "a<|im_start|>system\nb" + END, "a<|im_start|>system\nb"),
    ParseRow("a call inside the think block", "<think>" + CALL + "</think>\n\nok" + END, "<think>" + CALL + "</think>ok"),
    ParseRow("duplicate argument keys", DUPLICATE_KEYS + END, "", (("get_weather", {"city": "Lyon"}),)),
    ParseRow("escaped characters in the arguments", ESCAPED + END, "", (("get_weather", {"city": "París"}),)),
    ParseRow("a forced call completed", " " + json.dumps(ARGUMENTS) + "}\n</tool_call>" + END, "", (PARIS,), forced="get_weather"),
    ParseRow("a forced call completed with bad JSON", " {city: Paris}}\n</tool_call>" + END, FORCED_OPENING + 'get_weather", "arguments": {city: Paris}}\n</tool_call>', forced="get_weather"),
    ParseRow("a forced call of a function not offered", 'rm", "arguments": {}}\n</tool_call>' + END, FORCED_OPENING + 'rm", "arguments": {}}\n</tool_call>', forced=""),
]  # fmt: skip


@pytest.fixture(scope="module")
def codec(hosted_server: HostedServer) -> ChatCodec:
    model_dir = hosted_server.server.proc.data_dir.parent / "models"
    return ChatCodecs(model_dir, allow_remote_tokenizers=False).get("tinkerrpc/tiny-chat")


def _parsed(codec: ChatCodec, row: ParseRow) -> tuple[str, tuple[tuple[str, Any], ...]]:
    tokens = list(codec.tokenizer.encode(row.reply, add_special_tokens=False))
    opening = tool_call_opening(codec, row.forced) if row.forced is not None else []
    message = parse_reply(codec, tokens, opening, row.offered, False)
    return message.content, tuple((c.name, json.loads(c.arguments_json)) for c in message.tool_calls)


def test_parse_rows(codec: ChatCodec) -> None:
    failures = [
        f"{row.label}: expected {(row.content[:200], row.calls)}, got {(got[0][:200], got[1])}"
        for row in PARSE_ROWS
        if (got := _parsed(codec, row)) != (row.content, row.calls)
    ]
    print(f"\nparse rows: {len(PARSE_ROWS)}")
    assert not failures, "\n".join(failures)


# ---- reply rows


@dataclass(frozen=True)
class ReplyRow:
    label: str
    lesson: Lesson
    content: str | None
    calls: tuple[tuple[str, Any], ...]
    finish_reason: str
    options: dict[str, Any] = field(default_factory=dict)


CHATTER_40 = "\nIt is usually m"  # the chatter's first tokens after the call, 40 tokens in all
NAMED = {"type": "function", "function": {"name": "get_weather"}}

REPLY_ROWS = [
    ReplyRow("sidecar: the call", WEATHER, None, (PARIS,), "tool_calls"),
    ReplyRow("sidecar: the call, required", WEATHER, None, (PARIS,), "tool_calls", {"tool_choice": "required"}),
    ReplyRow("sidecar: the call, named", WEATHER, None, (PARIS,), "tool_calls", {"tool_choice": NAMED}),
    ReplyRow("sidecar: the call, one call only", WEATHER, None, (PARIS,), "tool_calls", {"parallel_tool_calls": False}),
    ReplyRow("sidecar: the call, reasoning_effort none", WEATHER, None, (PARIS,), "tool_calls", {"reasoning_effort": "none"}),
    ReplyRow("sidecar: the call, reasoning_effort high", WEATHER, None, (PARIS,), "tool_calls", {"reasoning_effort": "high"}),
    ReplyRow("sidecar: the call, thinking off", WEATHER, None, (PARIS,), "tool_calls", {"chat_template_kwargs": {"enable_thinking": False}, "reasoning_effort": "none"}),
    ReplyRow("sidecar: the call under ignore_eos, cut after its end", WEATHER, None, (PARIS,), "length", {"ignore_eos": True, "max_tokens": 32}),
    ReplyRow("sidecar: bad JSON", BAD_JSON, written(BAD_JSON), (), "stop"),
    ReplyRow("sidecar: bad JSON, one call only", BAD_JSON, written(BAD_JSON), (), "stop", {"parallel_tool_calls": False}),
    ReplyRow("sidecar: a function not offered", UNOFFERED, written(UNOFFERED), (), "stop"),
    ReplyRow("sidecar: a call then chatter, cut", CALL_THEN_CHATTER, CHATTER_40, (PARIS,), "length", {"max_tokens": 40}),
    ReplyRow("sidecar: a call then chatter, stopped by a string", CALL_THEN_CHATTER, "\nIt is usually ", (PARIS,), "tool_calls", {"stop": ["mild"]}),
    ReplyRow("sidecar: yes under ignore_eos, cut at its end", YES, "yes", (), "length", {"ignore_eos": True, "max_tokens": 8}),
    ReplyRow("sidecar: yes under ignore_eos, with logprobs", YES, "yes", (), "length", {"ignore_eos": True, "max_tokens": 8, "logprobs": True, "top_logprobs": 2}),
]  # fmt: skip


@pytest.fixture(scope="module")
def actor(hosted_server: HostedServer) -> str:
    version = taught_model(hosted_server.server.proc.target)
    if version is None:
        pytest.fail("greedy decoding did not reproduce every reply lesson")
    return version


def test_reply_rows(hosted_server: HostedServer, actor: str) -> None:
    failures: list[str] = []
    for row in REPLY_ROWS:
        body = {
            "model": actor,
            "messages": [question(row.lesson)],
            "tools": [WEATHER_TOOL],
            "temperature": 0,
            "max_tokens": 64,
            **row.options,
        }
        for kind, reply in zip(
            ("plain", "streamed"), both_replies(hosted_server.sidecar_url, body), strict=True
        ):
            got = (reply.content or None, tuple(reply.calls), reply.finish_reason)
            if got != (row.content, row.calls, row.finish_reason):
                failures.append(
                    f"{row.label} ({kind}): expected {(row.content, row.calls, row.finish_reason)}, got {got}"
                )
    print(f"\nreply rows: {len(REPLY_ROWS)}, each plain and streamed")
    assert not failures, "\n".join(failures)


# ---- refusal rows


def _chat(**fields: Any) -> dict[str, Any]:
    return {
        "model": "reply-actor",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 1,
        **fields,
    }


REFUSAL_ROWS = [
    HttpRow("reasoning_effort none, thinking on", CHAT, _chat(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}), 400, "reasoning_effort 'none' asks for thinking off, chat_template_kwargs.enable_thinking for the opposite [param reasoning_effort]"),
    HttpRow("reasoning_effort low, thinking off", CHAT, _chat(reasoning_effort="low", chat_template_kwargs={"enable_thinking": False}), 400, "reasoning_effort 'low' asks for thinking on, chat_template_kwargs.enable_thinking for the opposite [param reasoning_effort]"),
    HttpRow("reasoning_effort max", CHAT, _chat(reasoning_effort="max"), 400, "[param reasoning_effort]"),
    HttpRow("reasoning_effort empty", CHAT, _chat(reasoning_effort=""), 400, "[param reasoning_effort]"),
    HttpRow("reasoning_effort a number", CHAT, _chat(reasoning_effort=1), 400, "[param reasoning_effort]"),
    HttpRow("ignore_eos a string", CHAT, _chat(ignore_eos="yes"), 400, "[param ignore_eos]"),
    HttpRow("ignore_eos a number", COMPLETIONS, {"model": "reply-actor", "prompt": "x", "max_tokens": 1, "ignore_eos": 1}, 400, "[param ignore_eos]"),
    HttpRow("tool_choice required without tools, ignore_eos", CHAT, _chat(tool_choice="required", ignore_eos=True), 400, "tool_choice"),
]  # fmt: skip


def test_refusal_rows(hosted_server: HostedServer, actor: str) -> None:
    failures = []
    for row in REFUSAL_ROWS:
        status, message = http_outcome(hosted_server.sidecar_url, row)
        if status != row.status or row.needle.lower() not in message.lower():
            failures.append(f"{row.label} expected {row.status} with {row.needle!r}: got {status}: {message}")
    assert not failures, "\n".join(failures)


def test_the_campaign_has_its_rows() -> None:
    labels = [row.label for row in (*PARSE_ROWS, *REPLY_ROWS, *REFUSAL_ROWS)]
    assert len(set(labels)) == len(labels)
    assert len(labels) >= 30
