"""What every endpoint's request becomes: the SDK's `SamplingOptions`, passed as
`model.sample(prompt, options=...)`.

The endpoint modules decide their own fields (budget, logprobs, tools); what they share is translated
here once: temperature, top_p, top_k, seed and the pinned version for every endpoint, and for chat and
legacy completions the stop conditions and vLLM's extensions.
Pure functions: no I/O, so every mapping is testable without a server.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence
from typing import Any

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc.contract.limits import MAX_STOP_STRINGS
from tinkerrpc_server.sidecar.errors import bad_request
from tinkerrpc_server.sidecar.generate_protocol import GenerateSamplingParams
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.prompt_logprobs import prompt_logprob_options
from tinkerrpc_server.sidecar.protocol import SamplingFields
from tinkerrpc_server.sidecar.responses_protocol import ResponseRequest

# What the SDK accepts as a prompt: raw text, token ids, or OpenAI-style message dicts.
Prompt = str | list[int] | list[dict[str, Any]]

# The app's one Sample call, as the endpoint routes reach it: (route, model, prompt, arguments);
# it maps gRPC failures to OpenAI errors and counts the route's tokens.
Sampler = Callable[[str, ModelRef, Prompt, SamplingOptions], Awaitable[list[Sample]]]


def base_sample_args(
    request: SamplingFields | ResponseRequest | GenerateSamplingParams,
    ref: ModelRef,
    *,
    n: int,
    max_tokens: int,
    top_logprobs: int,
    **options: Any,
) -> SamplingOptions:
    """The knobs every endpoint's request shares, with OpenAI's defaults (temperature 1; top_k off at
    -1 or 0), and the pinned policy version of the model id; `options` are the endpoint's own."""
    return SamplingOptions(
        n=n,
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k or 0, 0),
        seed=request.seed,
        policy_version=ref.version,
        top_logprobs=top_logprobs,
        # Always on: stream deltas and OpenAI logprob tokens are built from the tokens' texts.
        return_token_texts=True,
        **options,
    )


def stop_list(stop: str | list[str] | None, param: str = "stop") -> list[str]:
    """The stop strings of a request, one or a list, checked in number and non-empty."""
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_STRINGS:
        raise bad_request(f"at most {MAX_STOP_STRINGS} stop sequences are supported, got {len(stops)}", param)
    if any(not s for s in stops):
        raise bad_request("stop sequences must be non-empty strings", param)
    return stops


# Knobs Tinker's sampler lacks, with the one value each is accepted at (which changes nothing).
NEUTRAL_KNOBS = {"presence_penalty": 0.0, "frequency_penalty": 0.0, "repetition_penalty": 1.0, "min_p": 0.0}


def check_neutral_knobs(request: SamplingFields | GenerateSamplingParams, prefix: str = "") -> None:
    """400 naming the first knob of NEUTRAL_KNOBS that `request` sets to another value."""
    for name, neutral in NEUTRAL_KNOBS.items():
        value = getattr(request, name, None)
        if value is not None and value != neutral:
            param = prefix + name
            raise bad_request(
                f"{param}={value} cannot be honoured: Tinker's sampler has no {name} knob "
                f"(only the neutral {neutral} is accepted)",
                param,
            )


def check_sampling_fields(request: SamplingFields) -> None:
    """400 naming the first parameter of chat and legacy completions the sampler cannot honour."""
    check_neutral_knobs(request)
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if any(t < 0 for t in request.stop_token_ids or ()):
        raise bad_request("stop_token_ids must be non-negative token ids", "stop_token_ids")


def sampling_fields_args(
    request: SamplingFields, ref: ModelRef, max_tokens: int, top_logprobs: int, **options: Any
) -> SamplingOptions:
    """The arguments of a chat or legacy completion request (checked by `check_sampling_fields`),
    with the stop conditions and vLLM's decoding options that both take."""
    if request.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    return base_sample_args(
        request,
        ref,
        n=request.n,
        max_tokens=max_tokens,
        top_logprobs=top_logprobs,
        stop=stop_list(request.stop),
        stop_token_ids=list(request.stop_token_ids or ()),
        ignore_default_stops=request.ignore_eos,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        **prompt_logprob_options(request.prompt_logprobs, request.stream),
        **options,
    )


def forced_tool_call(tool_choice: str | dict[str, Any] | None, tool_names: Sequence[str]) -> bool | str:
    """What a tool_choice forces: nothing (False), a call to any tool (True) or to the named function.
    A named choice is `{"type": "function", "function": {"name": N}}` (chat) or `{"type": "function",
    "name": N}` (Responses)."""
    if tool_choice in (None, "auto", "none"):
        return False
    if tool_choice == "required":
        if not tool_names:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return True
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or name not in tool_names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not one of the tools", "tool_choice"
            )
        return name
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or a function ({'type': 'function', ...})",
        "tool_choice",
    )


def tool_options(
    offered: list[dict[str, Any]],
    tool_names: Sequence[str],
    tool_choice: str | dict[str, Any] | None,
    parallel_tool_calls: bool | None,
) -> dict[str, Any]:
    """The tool options of `SamplingOptions`: the tools in chat form, what tool_choice forces, and whether
    a reply keeps more than its first call."""
    return {
        # With tool_choice "none" the tools are not offered to the model at all.
        "tools": offered if offered and tool_choice != "none" else None,
        "force_tool_call": forced_tool_call(tool_choice, tool_names),
        "parallel_tool_calls": parallel_tool_calls is not False,
    }
