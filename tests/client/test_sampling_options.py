"""`tinkerrpc.SamplingOptions`: its fields are the contract's sampling table, `Model.sample` takes it
instead of its keywords (the same request either way), and giving both is refused."""

from __future__ import annotations

import dataclasses
import inspect

import pytest

import tinkerrpc
from tinkerrpc import SamplingOptions
from tinkerrpc import _calls as calls
from tinkerrpc.contract.sampling import SAMPLING_OPTIONS

pytestmark = pytest.mark.unit

MESSAGES = [{"role": "user", "content": "hi"}]
TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


def test_its_fields_are_the_sampling_tables_options_in_order_with_their_defaults() -> None:
    fields = dataclasses.fields(SamplingOptions)
    assert [f.name for f in fields] == [option.name for option in SAMPLING_OPTIONS]
    assert [f.default for f in fields] == [option.default for option in SAMPLING_OPTIONS]


def test_sample_takes_each_field_as_a_keyword_with_the_same_default() -> None:
    parameters = inspect.signature(calls.sample).parameters
    keywords = [name for name in parameters if name not in ("model", "prompt", "options", "timeout")]
    assert keywords == [f.name for f in dataclasses.fields(SamplingOptions)]
    assert all(parameters[f.name].default == f.default for f in dataclasses.fields(SamplingOptions))


@pytest.mark.parametrize(
    ("prompt", "chosen"),
    [
        ("once upon", {"n": 3, "max_tokens": 7, "stop": ["."], "seed": 5, "top_logprobs": 2}),
        ([1, 2, 3], {"temperature": 0.0, "stop_token_ids": [9], "min_tokens": 2, "policy_version": 4}),
        (
            MESSAGES,
            {"tools": [TOOL], "force_tool_call": "f", "parallel_tool_calls": False, "enable_thinking": True},
        ),
    ],
)
def test_options_build_the_request_its_keywords_build(
    prompt: calls.Prompt, chosen: dict[str, object]
) -> None:
    by_keywords = calls.sample("run", prompt, **chosen)  # type: ignore[arg-type]
    by_options = calls.sample("run", prompt, options=SamplingOptions(**chosen))  # type: ignore[arg-type]
    assert by_options.request == by_keywords.request
    assert by_options.request != calls.sample("run", prompt).request


def test_options_and_a_keyword_together_are_refused() -> None:
    with pytest.raises(TypeError, match="not both"):
        calls.sample("run", "hi", n=2, options=SamplingOptions(n=3))


def test_bad_options_are_refused_when_built() -> None:
    with pytest.raises(ValueError, match="n must be >= 1"):
        SamplingOptions(n=0)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        SamplingOptions(max_tokens=0)
    with pytest.raises(TypeError, match="list of strings"):
        SamplingOptions(stop="END")
    with pytest.raises(ValueError, match="need a chat prompt"):
        calls.sample("run", [1, 2], options=SamplingOptions(tools=[TOOL]))


def test_it_is_a_public_name_of_the_sdk() -> None:
    assert "SamplingOptions" in tinkerrpc.__all__ and tinkerrpc.SamplingOptions is SamplingOptions
