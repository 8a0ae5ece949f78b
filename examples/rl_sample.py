"""An RL loop through `model.sample`: sample groups at the current policy, score them, train.

python examples/rl_sample.py --local
python examples/rl_sample.py --target 127.0.0.1:50051 --short
"""

from __future__ import annotations

import argparse
import asyncio

from example_support import TASKS, model_name, parser, reward, server_target

import tinkerrpc


async def rollout(
    model: tinkerrpc.AsyncModel, prompt: str, group_size: int, seed: int
) -> tinkerrpc.TrajectoryGroup:
    """One prompt, `group_size` completions; every trajectory carries the sampler's tokens, logprobs and version."""
    messages = [tinkerrpc.Message.user(prompt)]
    samples = await model.sample(messages, n=group_size, max_tokens=12, temperature=1.0, seed=seed)
    return tinkerrpc.TrajectoryGroup(
        [
            tinkerrpc.Trajectory.from_sample(messages, s, reward=reward(prompt, s.to_message().content))
            for s in samples
        ]
    )


async def train(target: str, args: argparse.Namespace) -> None:
    steps = 2 if args.short else args.steps
    async with tinkerrpc.AsyncClient(target, connect_timeout=60) as client:
        model = await client.create_model(
            model_name(args, "rl"), base_model=args.base_model, lora_rank=8, seed=0
        )
        print(f"created {model.name} on {args.base_model}")
        for step in range(1, steps + 1):
            gathered = await tinkerrpc.gather_groups(
                # Seeded per step and prompt so a run is reproducible.
                [
                    rollout(model, prompt, args.group_size, seed=100 * step + i)
                    for i, prompt in enumerate(TASKS)
                ],
                progress=False,
            )
            result = await model.train(
                gathered.results, loss="importance_sampling", learning_rate=args.learning_rate
            )
            m = result.metrics
            print(
                f"step {step}: mean_reward={gathered.rewards.mean:.3f} -> policy_version={result.policy_version} "
                f"(used {m.trajectories_used}, zero-variance dropped {m.dropped_zero_variance}, "
                f"stale dropped {m.dropped_stale})",
                flush=True,
            )
        print(f"done: policy_version={(await model.info()).policy_version}")


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group-size", type=int, default=8)
    p.add_argument("--learning-rate", type=float, default=3e-3)
    args = p.parse_args()
    with server_target(args) as target:
        asyncio.run(train(target, args))


if __name__ == "__main__":
    main()
