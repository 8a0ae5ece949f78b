"""ART's RL flow through tinkerrpc vs through ART's own TinkerNativeBackend (the seed), on the same engine.

Both sides run ART's yes-no-maybe flow as ART's docs write it (tests/art/art_flows.py: the same rollouts,
asking for no logprobs, 8 prompts x 8 rollouts a step, CISPO, until the rollouts' mean reward reaches
0.9): ours through `tinkerrpc.art` -> `serve --sidecar-port` -> its embedded engine, the seed through
`art.tinker_native.TinkerNativeBackend` -> `tinkerrpc engine` directly, warmed up through its raw tinker
training client (it has no SFT). Each round starts both sides afresh, in alternating order; each flow
runs in its own process (`import art` patches transformers in its process).

Figures: the median over rounds of each run's median RL step (its rollouts plus its Train), of each run's
median Train alone, of each run's warm-up alone (ours: ART's SFT, one Train of 20 minibatches; the seed: 20
forward_backward + optim_step on its raw training client, then its state and sampler saves), and the
median time from register to the rollouts that reached the target (warm-up included). The goals are here,
one constant each.
"""

from __future__ import annotations

import json
import statistics
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from bench.report import Figure, rounds
from bench.workload import Settings
from tinkerrpc_server.local.stack import LocalEngine, LocalStack

FLOWS = Path(__file__).resolve().parents[1] / "tests" / "art" / "art_flows.py"
FLOW_TIMEOUT_SECONDS = 900.0
STEP_GOAL = 0.7
TARGET_GOAL = 0.75
TRAIN_GOAL = 1.0
SFT_GOAL = 1.0
PARTS = ("rollout_seconds", "train_seconds")


def _flow(name: str, art_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(FLOWS), name, str(art_path), *args],
        capture_output=True,
        text=True,
        timeout=FLOW_TIMEOUT_SECONDS,
        env=env,
    )
    if done.returncode != 0:
        raise RuntimeError(f"ART flow {name} failed:\n{done.stderr[-3000:]}")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def _ours(work: Path, model_dir: Path) -> dict[str, Any]:
    args = ("--model-dir", str(model_dir))
    with LocalStack(work / "data", work / "serve.log", args, 240, with_sidecar=True) as stack:
        return _flow("yes-no-maybe", work / ".art", stack.target)


def _seed(work: Path, model_dir: Path) -> dict[str, Any]:
    with LocalEngine(work / "data", model_dir, work / "engine.log", startup_timeout=240.0) as engine:
        return _flow("seed-yes-no-maybe", work / ".art", env=engine.sdk_user_env())


def median_step_seconds(run: dict[str, Any]) -> float:
    """A run's median RL step: a trained step's rollouts plus its Train (the last rollouts, which reached
    the target, train no more and are left out)."""
    steps = [r + t for r, t in zip(run["rollout_seconds"], run["train_seconds"], strict=False)]
    if not steps:
        raise ValueError("the run reached the target before any RL step")
    return float(statistics.median(steps))


def median_train_seconds(run: dict[str, Any]) -> float:
    """A run's median Train call (ART's backend.train, the client's whole call)."""
    if not run["train_seconds"]:
        raise ValueError("the run reached the target before any RL step")
    return float(statistics.median(run["train_seconds"]))


def seconds_to_target(run: dict[str, Any]) -> float:
    if run["seconds_to_target"] is None:
        raise ValueError(f"the run never reached the target reward: {run['rewards']}")
    return float(run["seconds_to_target"])


def figures(ours: Sequence[dict[str, Any]], seed: Sequence[dict[str, Any]]) -> list[Figure]:
    """The four figures from the runs of each side; a round is a run of each."""
    steps = [[median_step_seconds(r) for r in runs] for runs in (ours, seed)]
    trains = [[median_train_seconds(r) for r in runs] for runs in (ours, seed)]
    warm_ups = [[float(r["sft_seconds"]) for r in runs] for runs in (ours, seed)]
    targets = [[seconds_to_target(r) for r in runs] for runs in (ours, seed)]
    sides = {"ours": ours, "seed": seed}
    rl_steps = {side: [len(r["train_seconds"]) for r in runs] for side, runs in sides.items()}
    parts = {
        side: " + ".join(f"{statistics.median(x for r in runs for x in r[key]):.2f}" for key in PARTS)
        for side, runs in sides.items()
    }
    common = (
        f"ART's yes-no-maybe flow on tiny-chat, rollouts asking no logprobs, 8 x 8 a step, CISPO, to mean "
        f"reward 0.9; {len(ours)} alternating rounds, each side started afresh; ours: tinkerrpc.art -> serve "
        f"-> its engine; seed: TinkerNativeBackend -> tinkerrpc engine"
    )
    return [
        Figure(
            "ART RL step, tinkerrpc vs TinkerNativeBackend on the same engine",
            statistics.median(steps[0]),
            statistics.median(steps[1]),
            "s",
            STEP_GOAL,
            "<=",
            f"{common}; median of each run's median step (rollouts + Train); median rollouts + Train: "
            f"ours {parts['ours']} s, seed {parts['seed']} s",
            rounds=rounds(*steps),
        ),
        Figure(
            "ART Train step alone, tinkerrpc vs TinkerNativeBackend",
            statistics.median(trains[0]),
            statistics.median(trains[1]),
            "s",
            TRAIN_GOAL,
            "<=",
            f"{common}; median of each run's median backend.train call (ours: one Train RPC, the sampler "
            f"weights and the full state saved and the version committed; seed: forward_backward, "
            f"optim_step, save_weights_for_sampler, create_sampling_client)",
            rounds=rounds(*trains),
        ),
        Figure(
            "ART SFT warm-up (20 steps of 32), tinkerrpc vs the seed's raw training client",
            statistics.median(warm_ups[0]),
            statistics.median(warm_ups[1]),
            "s",
            SFT_GOAL,
            "<=",
            f"{common}; ours: model.train_sft, one Train of 20 minibatches (20 forward_backward + "
            f"optim_step) committed with its sampler weights and full state; seed: TinkerNativeBackend has "
            f"no SFT, so its raw training client runs 20 forward_backward + optim_step on the same datums, "
            f"then saves its state and sampler once",
            rounds=rounds(*warm_ups),
        ),
        Figure(
            "ART time to mean reward 0.9, tinkerrpc vs TinkerNativeBackend",
            statistics.median(targets[0]),
            statistics.median(targets[1]),
            "s",
            TARGET_GOAL,
            "<=",
            f"{common}; from register to the rollouts that reached it, warm-up included (ours: ART's SFT; "
            f"seed: its raw training client); RL steps ours {rl_steps['ours']}, seed {rl_steps['seed']}",
            rounds=rounds(*targets),
        ),
    ]


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    """`settings.art_rounds` rounds of both flows (none in the short run: tests/art runs both)."""
    ours: list[dict[str, Any]] = []
    seed: list[dict[str, Any]] = []
    for round_index in range(settings.art_rounds):
        sides = [("ours", _ours, ours), ("seed", _seed, seed)]
        for side, run, runs in sides if round_index % 2 == 0 else reversed(sides):
            print(f"[bench]   art round {round_index + 1}: {side}", file=sys.stderr, flush=True)
            runs.append(run(work_dir / f"art-{side}-{round_index}", model_dir))
    return figures(ours, seed) if ours else []
