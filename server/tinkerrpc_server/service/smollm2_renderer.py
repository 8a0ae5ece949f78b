"""SmolLM2-Instruct's chat format as a tinker-cookbook renderer, registered under the name `smollm2`
in the cookbook's renderer registry (so `renderers.get_renderer("smollm2", tokenizer)` works in any
process that imported this module), and recommended by the cookbook's model_info for the built-in
HuggingFaceTB/SmolLM2-135M-Instruct, which the cookbook's own table does not know.

The format is SmolLM2's chat template exactly: every message, whatever its role, is
`<|im_start|>{role}\\n{content}<|im_end|>\\n` (a tool result is a `tool` turn, its text as it is), the
default system prompt comes first when the conversation does not open with a system message, and
there is no thinking block. The template writes no tool calls, so this renderer writes them as
Qwen/Hermes-style blocks after the assistant's text, and parses them back from sampled text:

    <tool_call>
    {"name": "lookup", "arguments": {"q": "weather"}}
    </tool_call>

Tools are declared in the system message (after the system prompt, the default one if none is
given) as Qwen3's renderer declares them, with the instructions to answer in that form."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import tinker
from tinker_cookbook import model_info, renderers
from tinker_cookbook.renderers import Message, Role, ToolSpec, TrainOnWhat
from tinker_cookbook.renderers.qwen3 import Qwen3InstructRenderer
from tinker_cookbook.tokenizer_utils import Tokenizer

from tinkerrpc_server.model_store import SMOLLM2_135M_INSTRUCT

if TYPE_CHECKING:  # `tinkerrpc serve` renders without torch (service/torchless.py)
    import torch

SMOLLM2_RENDERER = "smollm2"
DEFAULT_SYSTEM_PROMPT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"

_SMOLLM2_ATTRIBUTES = model_info.ModelAttributes(
    organization="HuggingFaceTB",
    version_str="2",
    size_str="135M",
    is_chat=True,
    recommended_renderers=(SMOLLM2_RENDERER,),
)


class SmolLM2Renderer(Qwen3InstructRenderer):
    """ChatML as SmolLM2-Instruct's template writes it (see the module's docstring)."""

    def _get_qwen_role_for_message(self, message: Message) -> str:
        return message["role"]

    def _wrap_qwen_tool_response(self, content: str) -> str:
        return content

    def build_generation_prompt(
        self, messages: list[Message], role: Role = "assistant", prefill: str | None = None
    ) -> tinker.ModelInput:
        return super().build_generation_prompt(_with_system_prompt(messages), role=role, prefill=prefill)

    def build_supervised_example(
        self, messages: list[Message], train_on_what: TrainOnWhat = TrainOnWhat.LAST_ASSISTANT_MESSAGE
    ) -> tuple[tinker.ModelInput, torch.Tensor]:
        return super().build_supervised_example(_with_system_prompt(messages), train_on_what=train_on_what)

    def create_conversation_prefix_with_tools(
        self, tools: list[ToolSpec], system_prompt: str = ""
    ) -> list[Message]:
        return super().create_conversation_prefix_with_tools(tools, system_prompt or DEFAULT_SYSTEM_PROMPT)


def _with_system_prompt(messages: list[Message]) -> list[Message]:
    if messages and messages[0]["role"] == "system":
        return messages
    return [Message(role="system", content=DEFAULT_SYSTEM_PROMPT), *messages]


def _smollm2_renderer(tokenizer: Tokenizer, image_processor: Any = None) -> SmolLM2Renderer:
    return SmolLM2Renderer(tokenizer)


def register() -> None:
    """Make `smollm2` a renderer name of the cookbook and the recommended renderer of the built-in
    SmolLM2 model (idempotent)."""
    renderers.register_renderer(SMOLLM2_RENDERER, _smollm2_renderer)
    if getattr(model_info.get_model_attributes, "_knows_smollm2", False):
        return
    cookbook_attributes = model_info.get_model_attributes

    # The cookbook has no registry for model attributes; its lookups all go through this function.
    def get_model_attributes(model_name: str) -> model_info.ModelAttributes:
        if model_name.split(":", 1)[0] == SMOLLM2_135M_INSTRUCT:
            return _SMOLLM2_ATTRIBUTES
        return cookbook_attributes(model_name)

    get_model_attributes._knows_smollm2 = True  # type: ignore[attr-defined]
    model_info.get_model_attributes = get_model_attributes
