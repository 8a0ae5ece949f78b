"""`SamplingOptions`: every option of `Model.sample()` as one frozen value, and the Sample request built
from it.

Its fields are the contract's sampling table (tinkerrpc.contract.sampling: names, order, defaults;
tests/foundation/test_contract.py holds them equal), so the SDK's keyword arguments, this class and the
sidecar, which builds one from each OpenAI request, cannot drift apart: a renamed field is a type error
where one is built.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from tinkerrpc import _convert as convert
from tinkerrpc._messages import MessageLike, Tool, as_messages
from tinkerrpc.contract.sampling import DEFAULT_MAX_TOKENS
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

Prompt = str | Sequence[int] | Sequence[MessageLike]
ToolLike = Tool | Mapping[str, Any]


@dataclass(frozen=True)
class SamplingOptions:
    """How `Model.sample(prompt, options=...)` samples; each field is the `sample()` keyword of the same
    name, with its default (the contract's sampling table says what each takes). Built once, it can be
    reused across calls and changed with `dataclasses.replace`."""

    n: int = 1
    max_tokens: int = DEFAULT_MAX_TOKENS
    temperature: float = 1.0
    top_p: float | None = None
    top_k: int = 0
    stop: Sequence[str] = ()
    stop_token_ids: Sequence[int] = ()
    seed: int | None = None
    policy_version: int | None = None
    tools: Sequence[ToolLike] | None = None
    top_logprobs: int = 0
    include_prompt_logprobs: bool = False
    prompt_top_logprobs: int = 0
    return_token_texts: bool = False
    ignore_default_stops: bool = False
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_prompt_text: bool = False
    enable_thinking: bool | None = None
    force_tool_call: bool | str = False
    parallel_tool_calls: bool = True

    def __post_init__(self) -> None:
        # The checks the server cannot phrase as well; its own range checks stay the authority.
        if self.n < 1:
            raise ValueError(f"n must be >= 1, got {self.n}")
        if self.max_tokens < 1:
            raise ValueError(f"max_tokens must be >= 1, got {self.max_tokens}")
        if isinstance(self.stop, str):
            raise TypeError("stop must be a list of strings, not a single string")

    @property
    def chat_only(self) -> bool:
        """Whether an option that needs a chat prompt (messages) is set."""
        return bool(
            self.tools
            or self.enable_thinking is not None
            or self.force_tool_call
            or not self.parallel_tool_calls
        )

    def _params(self) -> pb.SamplingParams:
        return pb.SamplingParams(
            n=self.n,
            max_tokens=self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            seed=self.seed,
            include_prompt_logprobs=self.include_prompt_logprobs,
            top_logprobs=self.top_logprobs,
            prompt_top_logprobs=self.prompt_top_logprobs,
            return_token_texts=self.return_token_texts,
            ignore_default_stops=self.ignore_default_stops,
            min_tokens=self.min_tokens,
            skip_special_tokens=self.skip_special_tokens,
            spaces_between_special_tokens=self.spaces_between_special_tokens,
            return_prompt_text=self.return_prompt_text,
        )

    def request(self, model: str, prompt: Prompt) -> service_pb.SampleRequest:
        """The Sample request for `prompt` (messages, token ids or text) on `model`."""
        request = service_pb.SampleRequest(
            model=model, policy_version=self.policy_version, params=self._params()
        )
        if isinstance(prompt, str):
            if self.chat_only:
                raise ValueError("tools and chat options need a chat prompt (a list of messages), not text")
            request.text = prompt
        elif not prompt:
            raise ValueError("the prompt is empty: give messages, token ids or text")
        elif all(isinstance(t, int) for t in prompt):
            if self.chat_only:
                raise ValueError(
                    "tools and chat options need a chat prompt (a list of messages), not token ids"
                )
            request.tokens.token_ids.extend(prompt)  # type: ignore[arg-type]
        else:
            chat = request.chat
            if self.enable_thinking is not None:
                chat.enable_thinking = self.enable_thinking
            if self.force_tool_call:
                forced = self.force_tool_call
                chat.forced_tool_call.function_name = forced if isinstance(forced, str) else ""
            chat.single_tool_call = not self.parallel_tool_calls
            messages = as_messages(prompt)  # type: ignore[arg-type]
            chat.messages.extend(convert.message_to_proto(m) for m in messages)
            chat.tools.extend(
                convert.tool_to_proto(t if isinstance(t, Tool) else Tool.from_openai(t))
                for t in self.tools or ()
            )
        return request
