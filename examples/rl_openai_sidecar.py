"""An RL loop through the `openai` client and the tinkerrpc sidecar.

Rollouts are ordinary chat completions (any agent code written against `openai` works); the
sidecar adds what training needs to each response: the sampled `token_ids`, the `policy_version`
and, with `logprobs=True`, the sampler's logprobs. `Trajectory.from_openai` reads them back.

    python examples/rl_openai_sidecar.py --local
    python examples/rl_openai_sidecar.py --target 127.0.0.1:50051 --sidecar-url http://127.0.0.1:8000/v1 --short
"""

from __future__ import annotations

import argparse
import asyncio
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import openai
from example_support import TASKS, local_sidecar, model_name, parser, reward, server_target
from openai.types.chat import ChatCompletionMessageParam

import tinkerrpc


async def rollout(
    llm: openai.AsyncOpenAI, model: str, prompt: str, group_size: int, seed: int
) -> tinkerrpc.TrajectoryGroup:
    messages: list[ChatCompletionMessageParam] = [{"role": "user", "content": prompt}]
    completion = await llm.chat.completions.create(
        model=model, messages=messages, n=group_size, max_tokens=12, temperature=1.0, logprobs=True, seed=seed
    )
    return tinkerrpc.TrajectoryGroup(
        [
            tinkerrpc.Trajectory.from_openai(
                messages, completion, reward=reward(prompt, choice.message.content or ""), choice_index=i
            )
            for i, choice in enumerate(completion.choices)
        ]
    )


async def train(target: str, sidecar_url: str, args: argparse.Namespace) -> None:
    steps = 2 if args.short else args.steps
    llm = openai.AsyncOpenAI(base_url=sidecar_url, api_key=args.api_key)
    async with tinkerrpc.AsyncClient(target, connect_timeout=60) as client:
        model = await client.create_model(
            model_name(args, "rl-openai"), base_model=args.base_model, lora_rank=8, seed=0
        )
        print(f"created {model.name} on {args.base_model}; sampling through {sidecar_url}")
        for step in range(1, steps + 1):
            gathered = await tinkerrpc.gather_groups(
                # Seeded per step and prompt so a run is reproducible.
                [
                    rollout(llm, model.name, prompt, args.group_size, 100 * step + i)
                    for i, prompt in enumerate(TASKS)
                ],
                max_concurrency=4,
                progress=not args.short,
            )
            sampled_at = {
                turn.policy_version for g in gathered.results for t in g.trajectories for turn in t.turns
            }
            result = await model.train(gathered.results, learning_rate=args.learning_rate, max_staleness=1)
            print(
                f"step {step}: sampled at v{sorted(sampled_at)}, mean_reward={gathered.rewards.mean:.3f} "
                f"-> policy_version={result.policy_version} (used {result.metrics.trajectories_used})",
                flush=True,
            )
        print(f"done: policy_version={(await model.info()).policy_version}")
    await llm.close()


@contextmanager
def sidecar_url(target: str, args: argparse.Namespace) -> Iterator[str]:
    if args.sidecar_url:
        yield str(args.sidecar_url)
        return
    with (
        tempfile.TemporaryDirectory(prefix="tinkerrpc-sidecar-") as work,
        local_sidecar(target, Path(work) / "sidecar.log", api_key=args.api_key) as url,
    ):
        yield url


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--sidecar-url", help="the sidecar's /v1 URL (default: start one for the server)")
    p.add_argument("--api-key", default=os.environ.get("TINKERRPC_SIDECAR_API_KEY", "tinkerrpc-example"))
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    args = p.parse_args()
    if args.local and args.sidecar_url:
        p.error("--sidecar-url goes with --target; --local starts its own sidecar")
    with server_target(args) as target, sidecar_url(target, args) as url:
        asyncio.run(train(target, url, args))


if __name__ == "__main__":
    main()
