"""The sidecar's copies of OpenAI's wire shapes (sidecar/openai_shapes.py) declare what the installed
`openai` package declares, field for field, and the sidecar's process never imports `openai`."""

from __future__ import annotations

import pytest
from import_graph import import_graph
from openai.types.chat import ChatCompletionTokenLogprob
from openai.types.chat.chat_completion import ChoiceLogprobs
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)
from openai.types.chat.chat_completion_token_logprob import TopLogprob
from openai.types.completion_choice import Logprobs
from openai.types.model import Model
from openai.types.responses import ResponseFunctionToolCall
from pydantic import BaseModel

from tinkerrpc_server.sidecar import openai_shapes

pytestmark = pytest.mark.unit

THEIRS: list[type[BaseModel]] = [
    TopLogprob,
    ChatCompletionTokenLogprob,
    ChoiceLogprobs,
    Function,
    ChatCompletionMessageFunctionToolCall,
    Logprobs,
    Model,
    ResponseFunctionToolCall,
]
# Optional fields of openai's that this server never sets (and so does not declare).
UNSET_BY_US = {"ResponseFunctionToolCall": {"async_", "caller", "namespace"}}


def _field_names(model: type[BaseModel]) -> set[str]:
    return set(model.model_fields)


@pytest.mark.parametrize("theirs", THEIRS, ids=lambda model: model.__name__)
def test_each_shape_declares_openais_fields(theirs: type[BaseModel]) -> None:
    ours = getattr(openai_shapes, theirs.__name__)
    expected = _field_names(theirs) - UNSET_BY_US.get(theirs.__name__, set())
    assert _field_names(ours) == expected
    for name in expected:
        assert ours.model_fields[name].is_required() == theirs.model_fields[name].is_required(), name


def test_a_dumped_shape_reads_back_as_openais() -> None:
    entry = openai_shapes.ChatCompletionTokenLogprob(
        token="a", bytes=[97], logprob=-0.5, top_logprobs=[openai_shapes.TopLogprob(token="a", logprob=-0.5)]
    )
    logprobs = openai_shapes.ChoiceLogprobs(content=[entry])
    assert (
        ChoiceLogprobs.model_validate_json(logprobs.model_dump_json()).model_dump() == logprobs.model_dump()
    )


def test_no_module_the_sidecar_app_reaches_imports_openai() -> None:
    # The SDK's openai imports are in the functions that make an openai client, which the sidecar never
    # calls; every other module the app reaches is checked.
    graph = import_graph("tinkerrpc_server", "tinkerrpc")
    app = "tinkerrpc_server.sidecar.app"
    importers = {
        module: " -> ".join(chain)
        for module, chain in {app: [app], **graph.reached(app)}.items()
        if not module.startswith(("tinkerrpc._openai", "tinkerrpc._methods"))
        and any(name == "openai" or name.startswith("openai.") for name in graph.names[module])
    }
    assert importers == {}
