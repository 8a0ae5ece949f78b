"""The sidecar bad-input campaign's row (a refused request and its expected answer) and its rows for
vLLM's /inference/v1/generate route (token ids and sampling_params); test_sidecar_bad_input.py holds the
OpenAI routes' rows and sends them all."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

MODEL = "bad-input"
# Beside /v1, at the server's root (as vLLM serves it).
GENERATE = "/inference/v1/generate"
HUGE_INT = "1" * 5000


@dataclass(frozen=True)
class Row:
    """One refused request: its route and body (a dict, or a raw JSON text), and the answer expected.
    A `param` ending in "…" is a prefix (paths into deep structures are long)."""

    name: str
    route: str
    body: dict[str, Any] | str
    status: int
    param: str

    def content(self) -> str:
        return self.body if isinstance(self.body, str) else json.dumps(self.body)


def nested_schema(depth: int) -> str:
    return '{"type": "object", "properties": {"a": ' * depth + "{}" + "}}" * depth


def generate(sampling: dict[str, Any] | None = None, **fields: Any) -> dict[str, Any]:
    return {
        "model": MODEL,
        "token_ids": [1, 2, 3],
        "sampling_params": {"max_tokens": 1, **(sampling or {})},
        **fields,
    }


def raw_generate(sampling_fields: str) -> str:
    """A generate body with `sampling_fields` (members of a JSON object, as text) in its sampling_params."""
    return json.dumps(generate())[:-2] + ", " + sampling_fields + "}}"


GENERATE_ROWS: list[Row] = [
    Row("generate-no-token-ids", GENERATE, {"model": MODEL, "sampling_params": {}}, 400, "token_ids"),
    Row("generate-empty-token-ids", GENERATE, generate(token_ids=[]), 400, "token_ids"),
    Row("generate-token-true", GENERATE, generate(token_ids=[1, True]), 400, "token_ids[1]"),
    Row("generate-token-float", GENERATE, generate(token_ids=[1.0]), 400, "token_ids[0]"),
    Row("generate-token-negative", GENERATE, generate(token_ids=[-1]), 400, "token_ids[0]"),
    Row("generate-token-beyond-int32", GENERATE, generate(token_ids=[2**31]), 400, "token_ids[0]"),
    Row("generate-token-outside-vocabulary", GENERATE, generate(token_ids=[1, 10**6]), 400, "token_ids"),
    Row(
        "generate-token-5000-digits",
        GENERATE,
        json.dumps(generate())[:-1].replace('"token_ids": [1, 2, 3]', f'"token_ids": [{HUGE_INT}]') + "}",
        400,
        "token_ids[0]",
    ),
    Row("generate-token-ids-string", GENERATE, generate(token_ids="1 2 3"), 400, "token_ids"),
    Row("generate-no-sampling-params", GENERATE, {"model": MODEL, "token_ids": [1]}, 400, "sampling_params"),
    Row("generate-sampling-params-list", GENERATE, generate(sampling_params=[]), 400, "sampling_params"),
    Row("generate-no-model", GENERATE, {"token_ids": [1], "sampling_params": {}}, 400, "model"),
    Row("generate-unknown-model", GENERATE, generate(model="ghost"), 404, "model"),
    Row("generate-superscript-version", GENERATE, generate(model=f"{MODEL}@²"), 404, "model"),
    Row("generate-n-true", GENERATE, generate({"n": True}), 400, "sampling_params.n"),
    Row("generate-n-17", GENERATE, generate({"n": 17}), 400, "sampling_params.n"),
    Row("generate-max-tokens-zero", GENERATE, generate({"max_tokens": 0}), 400, "sampling_params.max_tokens"),
    Row(
        "generate-max-tokens-float",
        GENERATE,
        generate({"max_tokens": 1.0}),
        400,
        "sampling_params.max_tokens",
    ),
    Row(
        "generate-max-tokens-over-the-server-limit",
        GENERATE,
        generate({"max_tokens": 10**6}),
        400,
        "sampling_params.max_tokens",
    ),
    Row(
        "generate-temperature-true",
        GENERATE,
        generate({"temperature": True}),
        400,
        "sampling_params.temperature",
    ),
    Row("generate-temperature-3", GENERATE, generate({"temperature": 3}), 400, "sampling_params.temperature"),
    Row(
        "generate-temperature-nan",
        GENERATE,
        raw_generate('"temperature": NaN'),
        400,
        "sampling_params.temperature",
    ),
    Row(
        "generate-temperature-overflow",
        GENERATE,
        raw_generate('"temperature": 1e999'),
        400,
        "sampling_params.temperature",
    ),
    Row("generate-top-p-zero", GENERATE, generate({"top_p": 0}), 400, "sampling_params.top_p"),
    Row("generate-top-k-beyond-int32", GENERATE, generate({"top_k": 2**31}), 400, "sampling_params.top_k"),
    Row("generate-seed-beyond-int64", GENERATE, generate({"seed": 2**64}), 400, "sampling_params.seed"),
    Row("generate-seed-string", GENERATE, generate({"seed": "7"}), 400, "sampling_params.seed"),
    Row("generate-logprobs-true", GENERATE, generate({"logprobs": True}), 400, "sampling_params.logprobs"),
    Row("generate-logprobs-21", GENERATE, generate({"logprobs": 21}), 400, "sampling_params.logprobs"),
    Row(
        "generate-prompt-logprobs-21",
        GENERATE,
        generate({"prompt_logprobs": 21}),
        400,
        "sampling_params.prompt_logprobs",
    ),
    Row(
        "generate-min-tokens-over-max-tokens",
        GENERATE,
        generate({"max_tokens": 2, "min_tokens": 3}),
        400,
        "sampling_params.min_tokens",
    ),
    Row(
        "generate-min-tokens-negative",
        GENERATE,
        generate({"min_tokens": -1}),
        400,
        "sampling_params.min_tokens",
    ),
    Row("generate-stop-empty", GENERATE, generate({"stop": [""]}), 400, "sampling_params.stop"),
    Row(
        "generate-stop-17",
        GENERATE,
        generate({"stop": [f"s{i}" for i in range(17)]}),
        400,
        "sampling_params.stop",
    ),
    Row(
        "generate-stop-token-ids-129",
        GENERATE,
        generate({"stop_token_ids": list(range(129))}),
        400,
        "sampling_params.stop_token_ids",
    ),
    Row(
        "generate-stop-token-id-negative",
        GENERATE,
        generate({"stop_token_ids": [-1]}),
        400,
        "sampling_params.stop_token_ids[0]",
    ),
    Row(
        "generate-stop-token-id-outside-vocabulary",
        GENERATE,
        generate({"stop_token_ids": [10**6]}),
        400,
        "sampling_params.stop_token_ids",
    ),
    Row("generate-ignore-eos-one", GENERATE, generate({"ignore_eos": 1}), 400, "sampling_params.ignore_eos"),
    Row(
        "generate-repetition-penalty",
        GENERATE,
        generate({"repetition_penalty": 1.2}),
        400,
        "sampling_params.repetition_penalty",
    ),
    Row("generate-min-p", GENERATE, generate({"min_p": 0.1}), 400, "sampling_params.min_p"),
    Row("generate-min-p-2", GENERATE, generate({"min_p": 2}), 400, "sampling_params.min_p"),
    Row(
        "generate-logit-bias",
        GENERATE,
        generate({"logit_bias": {"5": 1.0}}),
        400,
        "sampling_params.logit_bias",
    ),
    Row(
        "generate-allowed-token-ids",
        GENERATE,
        generate({"allowed_token_ids": [1]}),
        400,
        "sampling_params.allowed_token_ids",
    ),
    Row(
        "generate-structured-outputs-deep",
        GENERATE,
        raw_generate('"structured_outputs": {"json": ' + nested_schema(100) + "}"),
        400,
        "sampling_params.structured_outputs.json…",
    ),
    Row(
        "generate-structured-outputs",
        GENERATE,
        generate({"structured_outputs": {"json": {}}}),
        400,
        "sampling_params.structured_outputs",
    ),
    Row(
        "generate-unknown-sampling-param",
        GENERATE,
        generate({"guided_json": {}}),
        400,
        "sampling_params.guided_json",
    ),
    Row("generate-features", GENERATE, generate(features={"mm_hashes": {}}), 400, "features"),
    Row("generate-stream-number", GENERATE, generate(stream=1), 400, "stream"),
    Row(
        "generate-stream-options-without-stream",
        GENERATE,
        generate(stream_options={"include_usage": True}),
        400,
        "stream_options",
    ),
    Row(
        "generate-stream-options-unknown",
        GENERATE,
        generate(stream=True, stream_options={"continuous_usage": True}),
        400,
        "stream_options.continuous_usage",
    ),
    Row(
        "generate-stream-prompt-logprobs",
        GENERATE,
        generate({"prompt_logprobs": 0}, stream=True),
        400,
        "sampling_params.prompt_logprobs",
    ),
    Row("generate-priority", GENERATE, generate(priority=1), 400, "priority"),
    Row("generate-priority-beyond-int64", GENERATE, generate(priority=2**63), 400, "priority"),
    Row("generate-request-id-number", GENERATE, generate(request_id=7), 400, "request_id"),
    Row("generate-request-id-too-long", GENERATE, generate(request_id="r" * 257), 400, "request_id"),
    Row("generate-cache-salt-too-long", GENERATE, generate(cache_salt="s" * 257), 400, "cache_salt"),
]
