"""verifiers' own training client (verifiers.v1 TrainClient, unmodified) rolling out against the sidecar's
/inference/v1/generate; run by test_sidecar_verifiers.py with the Python of verifiers' own venv (its pins
clash with the suite's: openai<3, mcp==2.0.0).

    python verifiers_flow.py SIDECAR_URL MODEL SEED [SEED ...]

The sidecar's key comes in $SIDECAR_KEY (the client config names the variable, as verifiers does).
Each seed is one rollout of two turns, made as verifiers' interception server makes each turn: the
rollout's model and sampling imposed on the program's chat body (`ChatDialect.apply_overrides`), then
`TrainClient.get_response`, which renders the messages to token ids (the `renderers` package, with the
tiny model's tokenizer loaded by name from the Hugging Face cache the server laid it out in), POSTs them
to /inference/v1/generate and parses the tokens back. Prints one JSON line: per rollout, per turn, the
TurnTokens verifiers keeps for training, the parsed reply, and the context length it read from
/v1/models for its overflow check.
"""

from __future__ import annotations

import asyncio
import json
import sys
from typing import Any

from renderers import client as renderers_client
from renderers.configs import DefaultRendererConfig
from verifiers.v1.clients import ModelContext, TrainClientConfig, resolve_client
from verifiers.v1.dialects import ChatDialect
from verifiers.v1.types import SamplingConfig

KEY_VARIABLE = "SIDECAR_KEY"
# The base model's name, as prime-rl pins it (a policy version's name never drives tokenizer loading).
RENDERER_MODEL = "tinkerrpc/tiny-chat"
MAX_TOKENS = 8
QUESTION = "Is the sky blue?"
FOLLOW_UP = "Why?"


async def rollout(ctx: ModelContext, seed: int) -> list[dict[str, Any]]:
    dialect = ChatDialect()
    client = resolve_client(ctx.client)
    sampling = ctx.sampling.model_copy(update={"seed": seed})
    messages: list[dict[str, Any]] = [{"role": "user", "content": QUESTION}]
    turns = []
    try:
        for follow_up in (FOLLOW_UP, None):
            # What the program sent, with the rollout's model and sampling imposed on it.
            body = dialect.apply_overrides(
                {"model": "program-model", "messages": messages}, ctx.model, sampling
            )
            response = await client.get_response(dialect, body, sampling, session_id=f"rollout-{seed}")
            assert response.tokens is not None, "the train client returns the turn's tokens"
            assert response.usage is not None
            turns.append(
                {
                    "prompt_ids": list(response.tokens.prompt_ids),
                    "completion_ids": list(response.tokens.completion_ids),
                    "completion_logprobs": list(response.tokens.completion_logprobs),
                    "finish_reason": response.finish_reason,
                    "content": response.message.content,
                    "request_id": response.id,
                    "usage": [response.usage.prompt_tokens, response.usage.completion_tokens],
                }
            )
            # The program reads the reply verifiers serialized for it and sends it back next turn.
            assert response.raw is not None
            messages = [*messages, response.raw["choices"][0]["message"]]
            if follow_up is not None:
                messages.append({"role": "user", "content": follow_up})
    finally:
        await client.close()
    return turns


async def main(sidecar_url: str, model: str, seeds: list[int]) -> dict[str, Any]:
    config = TrainClientConfig(
        base_url=f"{sidecar_url}/v1",
        api_key_var=KEY_VARIABLE,
        # The tiny model's tokenizer has Qwen's chat tokens but not all the qwen3 renderer wants
        # (<tool_response>): the default renderer renders with the tokenizer's chat template.
        renderer=DefaultRendererConfig(),
        renderer_model_name=RENDERER_MODEL,
    )
    ctx = ModelContext(
        model=model, client=config, sampling=SamplingConfig(temperature=1.0, max_tokens=MAX_TOKENS)
    )
    rollouts = [await rollout(ctx, seed) for seed in seeds]
    # What renderers' pre-flight overflow check read from GET /v1/models (vLLM's max_model_len).
    max_prompt_len = renderers_client._max_prompt_len_cache.get((f"{sidecar_url}/v1/", model))
    return {"rollouts": rollouts, "max_prompt_len": max_prompt_len, "max_tokens": MAX_TOKENS}


if __name__ == "__main__":
    url, model_id, *seed_args = sys.argv[1:]
    print(json.dumps(asyncio.run(main(url, model_id, [int(s) for s in seed_args]))))
