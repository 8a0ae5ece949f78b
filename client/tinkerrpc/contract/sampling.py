"""The sampling-options table: every option of the SDK's `Model.sample()`, with its type, its default,
the values it takes, and where each layer exposes it: the gRPC field (`SamplingParams`, `SampleRequest`
or `ChatPrompt`) and the sidecar's request fields (`endpoint.field`, endpoint one of chat, completions,
responses, generate).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tinkerrpc.contract.limits import (
    MAX_STOP_STRING_BYTES,
    MAX_STOP_STRINGS,
    MAX_STOP_TOKEN_IDS,
    MAX_TEMPERATURE,
    MAX_TOP_LOGPROBS,
    MIN_TEMPERATURE,
    SIDECAR_MAX_N,
    SIDECAR_MAX_TEMPERATURE,
    markdown_table,
    server_flag,
)

# max_tokens when a request leaves it out: the SDK's; the sidecar's chat, Responses and generate
# requests'; and OpenAI's legacy completions default.
DEFAULT_MAX_TOKENS = 256
SIDECAR_CHAT_MAX_TOKENS = 512
SIDECAR_COMPLETION_MAX_TOKENS = 16

_MAX_N = server_flag("max_sample_n")
_MAX_TOKENS = server_flag("max_sample_tokens")


@dataclass(frozen=True)
class SamplingOption:
    """One option: `name` and `default` are the SDK's `sample()` keyword and its default; `values` says
    what it takes; `grpc` is its field (Message.field) and `sidecar` the sidecar fields that set it."""

    name: str
    type: str
    default: object
    values: str
    grpc: str
    sidecar: tuple[str, ...]


def _everywhere(field: str) -> tuple[str, ...]:
    """A field of every endpoint's request (generate's in its sampling_params)."""
    return (*_shared(field), f"responses.{field}")


def _shared(field: str) -> tuple[str, ...]:
    """A field of the request fields chat and legacy completions share, and of generate's sampling_params."""
    return (f"chat.{field}", f"completions.{field}", f"generate.sampling_params.{field}")


SAMPLING_OPTIONS: tuple[SamplingOption, ...] = (
    SamplingOption(
        "n",
        "int",
        1,
        f"1 to the server's {_MAX_N.flag} (default {_MAX_N.default}); the sidecar's at most {SIDECAR_MAX_N}",
        "SamplingParams.n",
        _shared("n"),
    ),
    SamplingOption(
        "max_tokens",
        "int",
        DEFAULT_MAX_TOKENS,
        f"1 to the server's {_MAX_TOKENS.flag} (default {_MAX_TOKENS.default}); prompt + max_tokens fit the "
        f"model's context (the sidecar's default: {SIDECAR_CHAT_MAX_TOKENS} for chat, Responses and generate, "
        f"{SIDECAR_COMPLETION_MAX_TOKENS} for legacy completions)",
        "SamplingParams.max_tokens",
        (
            "chat.max_tokens",
            "chat.max_completion_tokens",
            "completions.max_tokens",
            "responses.max_output_tokens",
            "generate.sampling_params.max_tokens",
        ),
    ),
    SamplingOption(
        "temperature",
        "float",
        1.0,
        f"0 (greedy) or [{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]; the sidecar's [0, {SIDECAR_MAX_TEMPERATURE:g}]",
        "SamplingParams.temperature",
        _everywhere("temperature"),
    ),
    SamplingOption(
        "top_p", "float | None", None, "(0, 1]; None is 1 (off)", "SamplingParams.top_p", _everywhere("top_p")
    ),
    SamplingOption(
        "top_k",
        "int",
        0,
        ">= 0, 0 is off (the sidecar's -1 is off too)",
        "SamplingParams.top_k",
        _everywhere("top_k"),
    ),
    SamplingOption(
        "stop",
        "Sequence[str]",
        (),
        f"at most {MAX_STOP_STRINGS}, each non-empty and at most {MAX_STOP_STRING_BYTES} UTF-8 bytes",
        "SamplingParams.stop",
        _shared("stop"),
    ),
    SamplingOption(
        "stop_token_ids",
        "Sequence[int]",
        (),
        f"at most {MAX_STOP_TOKEN_IDS} ids of the vocabulary, besides the end-of-turn tokens",
        "SamplingParams.stop_token_ids",
        _shared("stop_token_ids"),
    ),
    SamplingOption("seed", "int | None", None, "any int64", "SamplingParams.seed", _everywhere("seed")),
    SamplingOption(
        "policy_version",
        "int | None",
        None,
        "a sampleable version of the model (None: the current one; the sidecar's model id name@version)",
        "SampleRequest.policy_version",
        (),
    ),
    SamplingOption(
        "tools",
        "Sequence[Tool | Mapping] | None",
        None,
        "chat prompts only; each tool's parameters a JSON object",
        "ChatPrompt.tools",
        ("chat.tools", "responses.tools"),
    ),
    SamplingOption(
        "top_logprobs",
        "int",
        0,
        f"[0, {MAX_TOP_LOGPROBS}], 0 is off",
        "SamplingParams.top_logprobs",
        (
            "chat.top_logprobs",
            "completions.logprobs",
            "responses.top_logprobs",
            "generate.sampling_params.logprobs",
        ),
    ),
    SamplingOption(
        "include_prompt_logprobs",
        "bool",
        False,
        "also each prompt token's logprob",
        "SamplingParams.include_prompt_logprobs",
        ("generate.sampling_params.prompt_logprobs",),
    ),
    SamplingOption(
        "prompt_top_logprobs",
        "int",
        0,
        f"[0, {MAX_TOP_LOGPROBS}], 0 is off: the k most likely tokens at each prompt position",
        "SamplingParams.prompt_top_logprobs",
        (
            "chat.prompt_logprobs",
            "completions.prompt_logprobs",
            "generate.sampling_params.prompt_logprobs",
        ),
    ),
    SamplingOption(
        "return_token_texts",
        "bool",
        False,
        "also each sampled token's text and bytes (the sidecar always asks)",
        "SamplingParams.return_token_texts",
        (),
    ),
    SamplingOption(
        "ignore_default_stops",
        "bool",
        False,
        "only stop and stop_token_ids end a completion",
        "SamplingParams.ignore_default_stops",
        _shared("ignore_eos"),
    ),
    SamplingOption(
        "min_tokens",
        "int",
        0,
        "[0, max_tokens], 0 is off",
        "SamplingParams.min_tokens",
        _shared("min_tokens"),
    ),
    SamplingOption(
        "skip_special_tokens",
        "bool",
        True,
        "decode text without special tokens",
        "SamplingParams.skip_special_tokens",
        _shared("skip_special_tokens"),
    ),
    SamplingOption(
        "spaces_between_special_tokens",
        "bool",
        True,
        "space kept special tokens from their neighbours",
        "SamplingParams.spaces_between_special_tokens",
        _shared("spaces_between_special_tokens"),
    ),
    SamplingOption(
        "return_prompt_text",
        "bool",
        False,
        "also the prompt decoded as text",
        "SamplingParams.return_prompt_text",
        ("completions.echo",),
    ),
    SamplingOption(
        "enable_thinking",
        "bool | None",
        None,
        "chat prompts only; the renderer's thinking (True) or thinking-disabled (False) variant",
        "ChatPrompt.enable_thinking",
        ("chat.chat_template_kwargs",),
    ),
    SamplingOption(
        "force_tool_call",
        "bool | str",
        False,
        "chat prompts with tools: True forces a call to any tool, a name a call to that function",
        "ChatPrompt.forced_tool_call",
        ("chat.tool_choice", "responses.tool_choice"),
    ),
    SamplingOption(
        "parallel_tool_calls",
        "bool",
        True,
        "chat prompts only; False keeps each reply's first tool call (ChatPrompt.single_tool_call is its negation)",
        "ChatPrompt.single_tool_call",
        ("chat.parallel_tool_calls", "responses.parallel_tool_calls"),
    ),
)

SAMPLING_OPTION_BY_NAME: Mapping[str, SamplingOption] = {option.name: option for option in SAMPLING_OPTIONS}


def sampling_options_markdown() -> str:
    """The sampling-options table as Markdown (for the docs)."""
    rows = [
        (
            f"`{option.name}`",
            f"`{option.type}`",
            f"`{option.default!r}`",
            option.values,
            f"`{option.grpc}`",
            ", ".join(f"`{field}`" for field in option.sidecar) or "none",
        )
        for option in SAMPLING_OPTIONS
    ]
    return markdown_table(("option (SDK)", "type", "default", "values", "gRPC field", "sidecar fields"), rows)
