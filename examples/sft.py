"""Supervised fine-tuning through tinkerrpc: teach a model to answer each prompt with its word.

python examples/sft.py --local            # starts its own server
python examples/sft.py --target 127.0.0.1:50051 --short
"""

from __future__ import annotations

import random

from example_support import TASKS, model_name, parser, server_target

import tinkerrpc


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--learning-rate", type=float, default=1e-2)
    args = p.parse_args()
    steps = 2 if args.short else args.steps
    rng = random.Random(0)
    prompts = sorted(TASKS)

    with server_target(args) as target, tinkerrpc.Client(target, connect_timeout=60) as client:
        model = client.create_model(model_name(args, "sft"), base_model=args.base_model, lora_rank=8, seed=0)
        print(f"created {model.name} on {args.base_model}")
        for step in range(1, steps + 1):
            batch = [
                [tinkerrpc.Message.user(prompt), tinkerrpc.Message.assistant(TASKS[prompt])]
                for prompt in rng.choices(prompts, k=args.batch)
            ]
            # train_on="last": only the answer carries loss, not the prompt.
            result = model.train_supervised(batch, learning_rate=args.learning_rate, train_on="last")
            tokens = max(result.metrics.trained_tokens, 1)
            print(
                f"step {step}: policy_version={result.policy_version} "
                f"loss/token={result.metrics.loss / tokens:.3f} ({result.metrics.step_seconds:.2f} s)",
                flush=True,
            )
        for prompt in prompts:
            answer = model.sample([tinkerrpc.Message.user(prompt)], max_tokens=12, temperature=0.0)[0]
            print(f"{prompt!r} -> {answer.to_message().content!r} (v{answer.policy_version})")
        print(f"done: policy_version={model.info().policy_version}")


if __name__ == "__main__":
    main()
