"""Checkpoints: save a model's state, list checkpoints, sample an old policy version, restore, delete,
and export the adapter as a plain PEFT directory.

python examples/checkpoints.py --local
python examples/checkpoints.py --target 127.0.0.1:50051 --short
"""

from __future__ import annotations

import tempfile
from pathlib import Path

from example_support import TASKS, model_name, parser, server_target

import tinkerrpc


def sft_step(model: tinkerrpc.Model) -> int:
    batch = [[tinkerrpc.Message.user(p), tinkerrpc.Message.assistant(w)] for p, w in TASKS.items()]
    result = model.train_supervised(batch, learning_rate=1e-2, train_on="last")
    print(f"trained: policy_version={result.policy_version}")
    return result.policy_version


def main() -> None:
    p = parser(__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=5, help="steps to train after the saved checkpoint")
    args = p.parse_args()
    steps_after = 1 if args.short else args.steps
    probe = [tinkerrpc.Message.user("respond with yes")]

    with server_target(args) as target, tinkerrpc.Client(target, connect_timeout=60) as client:
        model = client.create_model(model_name(args, "ckpt"), base_model=args.base_model, lora_rank=8, seed=0)
        saved_version = sft_step(model)
        saved = model.save_checkpoint("milestone")
        print(f"saved {saved.name!r} at policy_version={saved.policy_version}: {saved.tinker_path}")
        for _ in range(steps_after):
            sft_step(model)

        # Every Train leaves a sampler checkpoint behind, so older versions stay sampleable (pinned).
        for c in model.checkpoints():
            print(f"  {c.kind:7s} {c.name:12s} v{c.policy_version}{' (automatic)' if c.automatic else ''}")
        print(f"sampleable versions: {list(model.info().sampleable_versions)}")
        for version in (saved_version, None):
            sample = model.sample(probe, max_tokens=12, temperature=0.0, policy_version=version)[0]
            print(f"pinned={version} -> sampled by v{sample.policy_version}: {sample.text!r}")

        latest = model.info().policy_version
        restored = model.restore(saved)
        print(f"restored {saved.name!r}: policy_version {latest} -> {restored.policy_version}")
        # The newer state checkpoints no longer lead anywhere; delete them (the restored one stays).
        for c in model.checkpoints():
            if c.kind == "state" and c.policy_version > restored.policy_version:
                model.delete_checkpoint(c)
                print(f"deleted {c.kind} checkpoint {c.name!r}")
        try:
            model.restore(f"step_{latest:06d}")
        except tinkerrpc.NotFoundError as error:
            print(f"restore of a deleted checkpoint fails: {error.code.name}")
        # The restored version's adapter, as files any PEFT-compatible server can load.
        with tempfile.TemporaryDirectory() as scratch:
            exported = model.export_weights(Path(scratch) / "adapter")
            print(f"exported v{exported.policy_version}: {', '.join(sorted(exported.files))}")
        print(f"done: policy_version={model.info().policy_version}")


if __name__ == "__main__":
    main()
