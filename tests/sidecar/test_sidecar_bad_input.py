"""The bad-input campaign against a real sidecar and server: every row is a request the sidecar must
refuse with OpenAI's 4xx error JSON naming the parameter, after which a good request still samples, and
no refused request leaves a traceback in the sidecar's log.

Bodies are raw JSON texts where Python's `json.dumps` could not write them (NaN, numbers beyond 4300
digits, nesting beyond the recursion limit).
"""

from __future__ import annotations

import json
from typing import Any

import httpx
import pytest
from bad_input_rows import GENERATE, GENERATE_ROWS, HUGE_INT, MODEL, Row, nested_schema
from sidecar_support import API_KEY, Stack

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "hi"}]
CHAT = "/chat/completions"
COMPLETIONS = "/completions"
RESPONSES = "/responses"


def chat(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": USER, "max_tokens": 1, **fields}


def raw_chat(fields: str) -> str:
    """A chat body with `fields` (a JSON object's members, as text) after the good ones."""
    return json.dumps(chat())[:-1] + ", " + fields + "}"


def legacy(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": "hi", "max_tokens": 1, **fields}


def response(**fields: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": "hi", "max_output_tokens": 1, **fields}


def tool(parameters: Any) -> dict[str, Any]:
    return {"type": "function", "function": {"name": "f", "parameters": parameters}}


def raw_tools(parameters: str) -> str:
    return raw_chat(
        f'"tools": [{{"type": "function", "function": {{"name": "f", "parameters": {parameters}}}}}]'
    )


def echoed_call(arguments: str) -> dict[str, Any]:
    call = {"id": "call_0", "type": "function", "function": {"name": "f", "arguments": arguments}}
    return chat(
        messages=[
            *USER,
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_0", "content": "ok"},
        ],
        tools=[tool({"type": "object"})],
    )


ARGUMENTS = "messages[1].tool_calls[0].function.arguments"

ROWS: list[Row] = [
    # ---- issue 28's cases
    Row("superscript-digit-version", CHAT, chat(model="h2@²"), 404, "model"),
    Row("arabic-indic-digit-version", CHAT, chat(model=f"{MODEL}@١"), 404, "model"),
    Row("version-beyond-int64", CHAT, chat(model=f"{MODEL}@99999999999999999999999"), 404, "model"),
    Row(
        "tool-parameters-600-deep", CHAT, raw_tools(nested_schema(600)), 400, "tools[0].function.parameters…"
    ),
    Row(
        "responses-text-format-string",
        RESPONSES,
        response(text={"format": "json_object"}),
        400,
        "text.format",
    ),
    Row("n-true", CHAT, chat(n=True), 400, "n"),
    Row("include-bogus", RESPONSES, response(include=["bogus.value"]), 400, "include[0]"),
    Row(
        "tool-parameters-5000-digits",
        CHAT,
        raw_tools(f'{{"a": {HUGE_INT}}}'),
        400,
        "tools[0].function.parameters.a",
    ),
    Row("arguments-5000-digits", CHAT, echoed_call(f'{{"a": {HUGE_INT}}}'), 400, f"{ARGUMENTS}.a"),
    Row("tool-parameters-nan", CHAT, raw_tools('{"a": NaN}'), 400, "tools[0].function.parameters.a"),
    Row(
        "tool-parameters-minus-infinity",
        CHAT,
        raw_tools('{"maximum": -Infinity}'),
        400,
        "tools[0].function.parameters.maximum",
    ),
    Row("arguments-infinity", CHAT, echoed_call('{"a": Infinity}'), 400, f"{ARGUMENTS}.a"),
    Row("arguments-nan", CHAT, echoed_call("[NaN]"), 400, f"{ARGUMENTS}[0]"),
    # ---- model strings: Unicode digits, confusables, malformed versions
    Row("fullwidth-digit-version", CHAT, chat(model=f"{MODEL}@１"), 404, "model"),
    Row("math-bold-digit-version", CHAT, chat(model=f"{MODEL}@𝟙"), 404, "model"),
    Row("devanagari-digit-version", CHAT, chat(model=f"{MODEL}@०"), 404, "model"),
    Row("cyrillic-a-in-name", CHAT, chat(model="bаd-input"), 404, "model"),
    Row("fullwidth-letter-name", CHAT, chat(model="ｂad-input"), 404, "model"),
    Row("negative-version", CHAT, chat(model=f"{MODEL}@-1"), 404, "model"),
    Row("float-version", CHAT, chat(model=f"{MODEL}@1.0"), 404, "model"),
    Row("hex-version", CHAT, chat(model=f"{MODEL}@0x1"), 404, "model"),
    Row("spaced-version", CHAT, chat(model=f"{MODEL}@ 1"), 404, "model"),
    Row("empty-version", CHAT, chat(model=f"{MODEL}@"), 404, "model"),
    Row("two-versions", CHAT, chat(model=f"{MODEL}@1@2"), 404, "model"),
    Row("version-of-5000-digits", CHAT, chat(model=f"{MODEL}@{'9' * 5000}"), 404, "model"),
    Row("legacy-arabic-digit-version", COMPLETIONS, legacy(model=f"{MODEL}@٠"), 404, "model"),
    Row("responses-superscript-version", RESPONSES, response(model=f"{MODEL}@¹"), 404, "model"),
    # ---- numbers: booleans, floats where integers go, strings, out of range, NaN and overflow
    Row("n-float", CHAT, chat(n=1.0), 400, "n"),
    Row("n-string", CHAT, chat(n="2"), 400, "n"),
    Row("n-zero", CHAT, chat(n=0), 400, "n"),
    Row("n-huge", CHAT, chat(n=10**30), 400, "n"),
    Row("temperature-true", CHAT, chat(temperature=True), 400, "temperature"),
    Row("temperature-string", CHAT, chat(temperature="0.5"), 400, "temperature"),
    Row("temperature-nan", CHAT, raw_chat('"temperature": NaN'), 400, "temperature"),
    Row("temperature-infinity", CHAT, raw_chat('"temperature": Infinity'), 400, "temperature"),
    Row("temperature-overflow", CHAT, raw_chat('"temperature": 1e999'), 400, "temperature"),
    Row("temperature-long-literal", CHAT, raw_chat('"temperature": 0.' + "5" * 200), 400, "temperature"),
    Row("top-p-true", CHAT, chat(top_p=True), 400, "top_p"),
    Row("top-p-zero", CHAT, chat(top_p=0), 400, "top_p"),
    Row("top-k-float", CHAT, chat(top_k=1.5), 400, "top_k"),
    Row("top-k-beyond-int32", CHAT, chat(top_k=2**31), 400, "top_k"),
    Row("seed-true", CHAT, chat(seed=True), 400, "seed"),
    Row("seed-beyond-int64", CHAT, chat(seed=2**64), 400, "seed"),
    Row("seed-5000-digits", CHAT, raw_chat(f'"seed": {HUGE_INT}'), 400, "seed"),
    Row("max-tokens-true", CHAT, {**chat(), "max_tokens": True}, 400, "max_tokens"),
    Row("max-tokens-beyond-int32", CHAT, {**chat(), "max_tokens": 2**40}, 400, "max_tokens"),
    Row("max-completion-tokens-string", CHAT, chat(max_completion_tokens="5"), 400, "max_completion_tokens"),
    Row("top-logprobs-true", CHAT, chat(logprobs=True, top_logprobs=True), 400, "top_logprobs"),
    Row("top-logprobs-21", CHAT, chat(logprobs=True, top_logprobs=21), 400, "top_logprobs"),
    Row("logprobs-one", CHAT, chat(logprobs=1), 400, "logprobs"),
    Row("prompt-logprobs-21", CHAT, chat(prompt_logprobs=21), 400, "prompt_logprobs"),
    Row("prompt-logprobs-stream", CHAT, chat(prompt_logprobs=1, stream=True), 400, "prompt_logprobs"),
    Row("stream-one", CHAT, chat(stream=1), 400, "stream"),
    Row("min-tokens-negative", CHAT, chat(min_tokens=-1), 400, "min_tokens"),
    Row("min-tokens-true", CHAT, chat(min_tokens=True), 400, "min_tokens"),
    Row("stop-token-id-true", CHAT, chat(stop_token_ids=[True]), 400, "stop_token_ids[0]"),
    Row("stop-token-id-beyond-int32", CHAT, chat(stop_token_ids=[2**31]), 400, "stop_token_ids[0]"),
    Row("logit-bias-nan", CHAT, raw_chat('"logit_bias": {"5": NaN}'), 400, "logit_bias.5"),
    Row("logit-bias-true", CHAT, chat(logit_bias={"5": True}), 400, "logit_bias[5]"),
    Row("presence-penalty-true", CHAT, chat(presence_penalty=True), 400, "presence_penalty"),
    Row("legacy-prompt-token-true", COMPLETIONS, legacy(prompt=[True]), 400, "prompt…"),
    Row("legacy-prompt-token-negative", COMPLETIONS, legacy(prompt=[-1]), 400, "prompt…"),
    Row("legacy-prompt-token-beyond-int32", COMPLETIONS, legacy(prompt=[2**31]), 400, "prompt…"),
    Row("legacy-logprobs-true", COMPLETIONS, legacy(logprobs=True), 400, "logprobs"),
    Row(
        "legacy-prompt-logprobs-stream",
        COMPLETIONS,
        legacy(prompt_logprobs=0, stream=True),
        400,
        "prompt_logprobs",
    ),
    Row("legacy-best-of-true", COMPLETIONS, legacy(best_of=True), 400, "best_of"),
    Row("legacy-echo-one", COMPLETIONS, legacy(echo=1), 400, "echo"),
    Row(
        "responses-max-output-tokens-true",
        RESPONSES,
        response(max_output_tokens=True),
        400,
        "max_output_tokens",
    ),
    Row("responses-top-k-beyond-int32", RESPONSES, response(top_k=2**31), 400, "top_k"),
    Row("responses-seed-float", RESPONSES, response(seed=1.0), 400, "seed"),
    Row("responses-temperature-true", RESPONSES, response(temperature=True), 400, "temperature"),
    Row("responses-max-tool-calls-zero", RESPONSES, response(max_tool_calls=0), 400, "max_tool_calls"),
    # ---- unknown enum strings
    Row("role-bogus", CHAT, chat(messages=[{"role": "bogus", "content": "x"}]), 400, "messages[0].role"),
    Row("role-uppercase", CHAT, chat(messages=[{"role": "USER", "content": "x"}]), 400, "messages[0].role"),
    Row("tool-choice-bogus", CHAT, chat(tool_choice="bogus"), 400, "tool_choice"),
    Row("tool-choice-type-bogus", CHAT, chat(tool_choice={"type": "bogus"}), 400, "tool_choice"),
    Row(
        "response-format-type-bogus",
        CHAT,
        chat(response_format={"type": "bogus"}),
        400,
        "response_format.type",
    ),
    Row("response-format-string", CHAT, chat(response_format="json_object"), 400, "response_format"),
    Row(
        "response-format-json-schema",
        CHAT,
        chat(response_format={"type": "json_schema", "json_schema": {}}),
        400,
        "response_format",
    ),
    Row("reasoning-effort-bogus", CHAT, chat(reasoning_effort="extreme"), 400, "reasoning_effort"),
    Row("verbosity-bogus", CHAT, chat(verbosity="loud"), 400, "verbosity"),
    Row("service-tier-bogus", CHAT, chat(service_tier="bogus"), 400, "service_tier"),
    Row("modality-bogus", CHAT, chat(modalities=["video"]), 400, "modalities[0]"),
    Row(
        "stream-options-string-flag",
        CHAT,
        chat(stream=True, stream_options={"include_usage": "yes"}),
        400,
        "stream_options.include_usage",
    ),
    Row(
        "stream-options-unknown-key",
        CHAT,
        chat(stream=True, stream_options={"bogus": True}),
        400,
        "stream_options.bogus",
    ),
    Row(
        "tool-type-bogus",
        CHAT,
        chat(tools=[{"type": "bogus", "function": {"name": "f"}}]),
        400,
        "tools[0].type",
    ),
    Row(
        "responses-text-format-type-bogus",
        RESPONSES,
        response(text={"format": {"type": "bogus"}}),
        400,
        "text.format.type",
    ),
    Row(
        "responses-text-verbosity-bogus",
        RESPONSES,
        response(text={"verbosity": "loud"}),
        400,
        "text.verbosity",
    ),
    Row("responses-truncation-bogus", RESPONSES, response(truncation="bogus"), 400, "truncation"),
    Row("responses-service-tier-bogus", RESPONSES, response(service_tier="bogus"), 400, "service_tier"),
    Row(
        "responses-stream-options-flag-one",
        RESPONSES,
        response(stream=True, stream_options={"include_obfuscation": 1}),
        400,
        "stream_options.include_obfuscation",
    ),
    Row("responses-tool-choice-bogus", RESPONSES, response(tool_choice="bogus"), 400, "tool_choice"),
    Row(
        "responses-include-number",
        RESPONSES,
        response(include=["message.output_text.logprobs", 5]),
        400,
        "include[1]",
    ),
    Row(
        "responses-input-role-bogus",
        RESPONSES,
        response(input=[{"type": "message", "role": "bogus", "content": "x"}]),
        400,
        "input[0].role",
    ),
    # ---- depth and size of every nested structure
    Row(
        "content-part-extra-deep",
        CHAT,
        raw_chat(
            '"metadata": {}, "messages": [{"role": "user", "content": [{"type": "text", "text": "x", "x": '
            + "[" * 100
            + "]" * 100
            + "}]}]"
        ),
        400,
        "messages[0].content[0].x…",
    ),
    Row(
        "messages-2000-deep",
        CHAT,
        json.dumps({"model": MODEL, "max_tokens": 1})[:-1] + ', "messages": ' + "[" * 2000 + "]" * 2000 + "}",
        400,
        "messages[0][0]…",
    ),
    Row(
        "response-format-schema-deep",
        CHAT,
        raw_chat(
            '"response_format": {"type": "json_schema", "json_schema": {"schema": '
            + nested_schema(100)
            + "}}"
        ),
        400,
        "response_format.json_schema.schema…",
    ),
    Row(
        "tool-parameters-too-many-keys",
        CHAT,
        chat(tools=[tool({"properties": {f"k{i}": {} for i in range(140_000)}})]),
        400,
        "tools[0].function.parameters.properties",
    ),
    Row(
        "messages-too-many",
        CHAT,
        chat(messages=[{"role": "user", "content": "x"}] * 140_000),
        400,
        "messages",
    ),
    Row("arguments-deep", CHAT, echoed_call("[" * 100 + "]" * 100), 400, f"{ARGUMENTS}[0]…"),
    Row(
        "responses-tool-parameters-deep",
        RESPONSES,
        response(tools=[{"type": "function", "name": "f", "parameters": json.loads(nested_schema(80))}]),
        400,
        "tools[0].parameters…",
    ),
    Row(
        "responses-arguments-nan",
        RESPONSES,
        response(
            input=[
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": '{"a": NaN}'},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ]
        ),
        400,
        "input[0].arguments.a",
    ),
    Row(
        "legacy-prompt-5000-digit-token",
        COMPLETIONS,
        json.dumps(legacy())[:-1] + f', "prompt": [{HUGE_INT}]}}',
        400,
        "prompt[0]",
    ),
    Row("metadata-value-number", CHAT, chat(metadata={"k": 1}), 400, "metadata.k"),
    # ---- /inference/v1/generate: vLLM's token ids and sampling_params (bad_input_rows.py)
    *GENERATE_ROWS,
]


@pytest.fixture(scope="module")
def bad_input_model(stack: Stack) -> str:
    stack.client.create_model(MODEL, base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return MODEL


def post(stack: Stack, route: str, content: str) -> httpx.Response:
    base = stack.sidecar.base_url if route == GENERATE else stack.sidecar.openai_base_url
    return httpx.post(
        f"{base}{route}",
        content=content.encode(),
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
        timeout=60,
    )


def test_the_campaign_has_its_rows() -> None:
    assert len({row.name for row in ROWS}) == len(ROWS)
    # Rows are only ever added: with the gRPC campaign (tests/hardening/test_bad_input_campaign.py) >= 280.
    assert len(ROWS) >= 100


@pytest.mark.parametrize("row", ROWS, ids=[row.name for row in ROWS])
def test_bad_input_is_refused_naming_the_parameter(stack: Stack, bad_input_model: str, row: Row) -> None:
    refused = post(stack, row.route, row.content())
    assert refused.status_code == row.status, (row.name, refused.text[:500])
    error = refused.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error", error
    if row.param.endswith("…"):
        assert (error["param"] or "").startswith(row.param[:-1]), (row.name, error)
    else:
        assert error["param"] == row.param, (row.name, error)
    if row.status == 404:
        assert error["code"] == "model_not_found", error
    assert refused.headers["x-should-retry"] == "false"
    good = post(stack, CHAT, json.dumps(chat()))
    assert good.status_code == 200, good.text[:500]
    assert good.json()["model"] == f"{MODEL}@0"


def test_refused_requests_leave_no_traceback(stack: Stack, bad_input_model: str) -> None:
    for row in ROWS:
        assert post(stack, row.route, row.content()).status_code == row.status, row.name
    log = stack.sidecar.log()
    assert "Traceback" not in log and "unexpected sidecar error" not in log, log[-3000:]
