"""SFT through the SDK: the random tiny chat model learns to answer with exactly one of yes / no / maybe.

The `qwen3_disable_thinking` renderer puts the empty think block in the prompt, so an answer is two
tokens (word + <|im_end|>); with plain `qwen3` the model must also learn the six-token think block,
which takes ~3x the steps for the same lesson.
"""

from __future__ import annotations

import random
import time

import numpy as np
import pytest
import tinker
from engine_proc import TINY
from tinker import types
from tinker_cookbook import renderers
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import ANSWER_WORDS, answer_format_prompt

pytestmark = pytest.mark.process

BATCH_SIZE = 32
EVAL_SAMPLES = 48
MAX_STEPS = 80
EVAL_EVERY = 5


def answer_text(message: renderers.Message) -> str:
    content = message["content"]
    if isinstance(content, str):
        return content.strip()
    return "".join(part.get("text", "") for part in content if part.get("type") == "text").strip()


def test_sft_teaches_the_answer_format(service: tinker.ServiceClient, engine: LocalEngine) -> None:
    # Creating the model makes the engine build the tiny model directory the tokenizer is read from.
    client = service.create_lora_training_client(TINY, rank=8, seed=0).result()
    tokenizer = get_tokenizer(str(engine.model_dir / TINY))
    renderer = renderers.get_renderer("qwen3_disable_thinking", tokenizer)
    rng = random.Random(0)

    def example() -> types.Datum:
        messages: list[renderers.Message] = [
            {"role": "user", "content": answer_format_prompt(rng)},
            {"role": "assistant", "content": rng.choice(ANSWER_WORDS)},
        ]
        model_input, weights = renderer.build_supervised_example(messages)
        tokens = model_input.to_ints()
        return types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                "weights": weights[1:].numpy().astype(np.float32),
            },
        )

    def valid_fraction(client: tinker.TrainingClient) -> float:
        sampler = client.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=4, temperature=1.0, stop=renderer.get_stop_sequences())
        prompts = [
            renderer.build_generation_prompt([{"role": "user", "content": answer_format_prompt(rng)}])
            for _ in range(EVAL_SAMPLES // 8)
        ]
        responses = [f.result() for f in [sampler.sample(p, 8, params) for p in prompts]]
        answers = [renderer.parse_response(list(s.tokens)) for r in responses for s in r.sequences]
        return sum(answer_text(message) in ANSWER_WORDS for message, _ in answers) / len(answers)

    assert valid_fraction(client) < 0.5, "the random model must not already know the format"
    started = time.monotonic()
    # 1e-2 overshoots on this model: ~90% valid at step 10, then 10-30% for ~50 steps, so whether 95%
    # came by step 80 was chance; 3e-3 climbs steadily (95%+ by step 35-40).
    adam = types.AdamParams(learning_rate=3e-3)
    history: list[tuple[int, float]] = []
    for step in range(1, MAX_STEPS + 1):
        client.forward_backward([example() for _ in range(BATCH_SIZE)], "cross_entropy")
        client.optim_step(adam).result()
        if step % EVAL_EVERY == 0:
            history.append((step, valid_fraction(client)))
            if history[-1][1] >= 0.95:
                break
    elapsed = time.monotonic() - started
    print(f"SFT: {history[-1][1]:.0%} valid after {history[-1][0]} steps, {elapsed:.1f} s; history {history}")
    assert history[-1][1] >= 0.95, history
