"""Figure 5: encode + decode of a 1M-token Train request, SDK dataclasses → wire bytes → the objects the
server works with: the client's protobuf path (the SDK's own request builder, packed repeated fields)
vs JSON of the same data (stdlib json, the way a REST API would carry it)."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from bench.report import Figure, rounds
from bench.workload import Settings
from tinkerrpc import SampledTurn, Trajectory, TrajectoryGroup
from tinkerrpc._calls import train
from tinkerrpc.v1 import trainer_service_pb2

TURN_TOKENS = 1024
GROUP_SIZE = 8
SERIALIZATION_GOAL = 1.0


def trajectory_groups(completion_tokens: int, vocab_size: int = 151_936) -> list[TrajectoryGroup]:
    """RL data with `completion_tokens` sampled tokens: one turn of 1024 prompt + 1024 completion tokens
    per trajectory (Qwen-sized vocabulary, so ids take realistic varint widths)."""
    rng = np.random.default_rng(3)
    trajectories = [
        Trajectory(
            turns=[
                SampledTurn(
                    prompt_token_ids=rng.integers(0, vocab_size, TURN_TOKENS).tolist(),
                    completion_token_ids=rng.integers(0, vocab_size, TURN_TOKENS).tolist(),
                    logprobs=(-rng.random(TURN_TOKENS)).astype(np.float32).tolist(),
                    policy_version=3,
                )
            ],
            reward=float(i % 3),
        )
        for i in range(max(1, completion_tokens // TURN_TOKENS))
    ]
    return [
        TrajectoryGroup(trajectories[i : i + GROUP_SIZE]) for i in range(0, len(trajectories), GROUP_SIZE)
    ]


def _proto_encode(groups: list[TrajectoryGroup]) -> bytes:
    wire: bytes = train("bench", groups, idempotency_key="bench").request.SerializeToString()
    return wire


def _proto_decode(wire: bytes) -> list[tuple[list[int], list[int], list[float]]]:
    """Parse as the gRPC server does, then read every turn's arrays as the datum builder does."""
    request = trainer_service_pb2.TrainRequest.FromString(wire)
    return [
        (list(turn.prompt_token_ids), list(turn.completion_token_ids), list(turn.completion_logprobs))
        for group in request.groups
        for trajectory in group.trajectories
        for turn in trajectory.turns
    ]


def _json_encode(groups: list[TrajectoryGroup]) -> bytes:
    body: dict[str, Any] = {
        "model": "bench",
        "loss": {"function": "importance_sampling"},
        "adam": {"learning_rate": 1e-4},
        "idempotency_key": "bench",
        "groups": [
            {
                "trajectories": [
                    {
                        "reward": trajectory.reward,
                        "turns": [
                            {
                                "prompt_token_ids": list(turn.prompt_token_ids),
                                "completion_token_ids": list(turn.completion_token_ids),
                                "completion_logprobs": list(turn.logprobs),
                                "policy_version": turn.policy_version,
                            }
                            for turn in trajectory.turns
                        ],
                    }
                    for trajectory in group.trajectories
                ]
            }
            for group in groups
        ],
    }
    return json.dumps(body, separators=(",", ":")).encode()


def _json_decode(wire: bytes) -> list[tuple[list[int], list[int], list[float]]]:
    request = json.loads(wire)
    return [
        (turn["prompt_token_ids"], turn["completion_token_ids"], turn["completion_logprobs"])
        for group in request["groups"]
        for trajectory in group["trajectories"]
        for turn in trajectory["turns"]
    ]


def _round_trip_seconds(
    encode: Callable[[list[TrajectoryGroup]], bytes],
    decode: Callable[[bytes], list[tuple[list[int], list[int], list[float]]]],
    groups: list[TrajectoryGroup],
    repeats: int,
) -> tuple[list[float], bytes]:
    """Each repeat's seconds, and the wire bytes."""
    times = []
    wire = b""
    for _ in range(repeats):
        started = time.perf_counter()
        wire = encode(groups)
        decode(wire)
        times.append(time.perf_counter() - started)
    return times, wire


def measure(settings: Settings) -> list[Figure]:
    groups = trajectory_groups(settings.serialization_tokens)
    turns = [turn for group in groups for trajectory in group.trajectories for turn in trajectory.turns]
    # Both formats must hand the server the same arrays; float32 logprobs survive both exactly.
    if _proto_decode(_proto_encode(groups)) != _json_decode(_json_encode(groups)):
        raise AssertionError("protobuf and JSON round trips disagree")
    payload_mb = (
        4 * sum(len(t.prompt_token_ids) + len(t.completion_token_ids) + len(t.logprobs) for t in turns) / 1e6
    )
    proto_seconds, proto_wire = _round_trip_seconds(
        _proto_encode, _proto_decode, groups, settings.serialization_repeats
    )
    json_seconds, json_wire = _round_trip_seconds(
        _json_encode, _json_decode, groups, settings.serialization_repeats
    )
    completion = sum(len(t.completion_token_ids) for t in turns)
    proto_rates = [payload_mb / seconds for seconds in proto_seconds]
    json_rates = [payload_mb / seconds for seconds in json_seconds]
    return [
        Figure(
            name="Train request encode+decode",
            ours=statistics.median(proto_rates),
            baseline=statistics.median(json_rates),
            unit="payload MB/s",
            goal=SERIALIZATION_GOAL,
            direction=">=",
            rounds=rounds(proto_rates, json_rates),
            detail=(
                f"{len(turns)} trajectories, {completion} completion + {completion} prompt tokens with float32 "
                f"logprobs ({payload_mb:.1f} MB as int32/float32 arrays); ours: SDK dataclasses → TrainRequest → "
                f"bytes ({len(proto_wire) / 1e6:.1f} MB) → parsed message → Python lists, "
                f"{statistics.median(proto_seconds):.2f} s; JSON: same dataclasses → json bytes "
                f"({len(json_wire) / 1e6:.1f} MB) → lists, {statistics.median(json_seconds):.2f} s; median "
                f"of {settings.serialization_repeats}, each format's repeats in a row"
            ),
        )
    ]
