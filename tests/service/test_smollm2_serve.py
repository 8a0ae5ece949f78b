"""The built-in SmolLM2 through a real `tinkerrpc serve`: CreateModel by its hub name (the server
converts it on first use), Sample on the engine, and the pretrained model answering a sum greedily. The
engine samples a Llama model on its transformers fallback, so the samples are few and short."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from smollm2_support import SMOLLM2
from svc import Server, user
from transformers import AutoTokenizer

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

# Converting the GGUF and loading a 135 M model in the engine, on a busy 2-core machine.
FIRST_USE_TIMEOUT = 600.0
SAMPLE_TIMEOUT = 300.0
NAME = "smollm2-model"


@pytest.fixture(scope="module")
def model(server: Server) -> Iterator[types_pb2.ModelInfo]:
    request = pb.CreateModelRequest(name=NAME, base_model=SMOLLM2, lora=types_pb2.LoraConfig(rank=4), seed=7)
    yield server.stub.CreateModel(request, timeout=FIRST_USE_TIMEOUT).model
    server.stub.DeleteModel(pb.DeleteModelRequest(name=NAME), timeout=SAMPLE_TIMEOUT)


def _sample(server: Server, question: str, params: types_pb2.SamplingParams) -> pb.SampleResponse:
    request = pb.SampleRequest(model=NAME, chat=pb.ChatPrompt(messages=[user(question)]), params=params)
    return server.stub.Sample(request, timeout=SAMPLE_TIMEOUT)


def test_created_by_name_with_its_renderer_and_sampled(
    server: Server, model: types_pb2.ModelInfo, service_model_dir: Path
) -> None:
    assert model.renderer == "smollm2"
    assert (model.vocab_size, model.max_context_length, model.policy_version) == (49_152, 8192, 0)
    response = _sample(server, "hi", types_pb2.SamplingParams(n=1, max_tokens=8, seed=3))
    tokenizer = AutoTokenizer.from_pretrained(service_model_dir / SMOLLM2)
    template = tokenizer.apply_chat_template(
        [{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True
    )
    assert list(response.prompt_token_ids) == tokenizer.encode(template, add_special_tokens=False)
    [sequence] = response.sequences
    assert 0 < len(sequence.token_ids) <= 8 and len(sequence.logprobs) == len(sequence.token_ids)
    assert sequence.text == tokenizer.decode(sequence.token_ids, skip_special_tokens=True)


def test_the_pretrained_model_answers_a_sum_greedily(server: Server, model: types_pb2.ModelInfo) -> None:
    params = types_pb2.SamplingParams(n=1, max_tokens=16, temperature=0.0)
    response = _sample(server, "What is 7 + 5? Answer with a number.", params)
    assert "12" in response.sequences[0].text, response.sequences[0].text
