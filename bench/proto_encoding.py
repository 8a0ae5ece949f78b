"""Encode + decode of a 1M-token Train request: packed repeated fields vs raw bytes.

Decides how protos/tinkerrpc/v1 carries token ids and logprobs (see docs/encoding.md).
Both variants carry the same data: 512 trajectories, each one turn of 1024 prompt + 1024
completion tokens (1M completion tokens, 1M prompt tokens) with float32 logprobs.

Usage: python bench/proto_encoding.py [--tokens N]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import numpy as np
from google.protobuf import descriptor_pb2, descriptor_pool, message_factory

from tinkerrpc.v1 import trainer_service_pb2


def _bytes_turn_class() -> type:
    """A SampledTurn twin whose arrays are little-endian bytes (the alternative encoding)."""
    file_proto = descriptor_pb2.FileDescriptorProto(
        name="bench_bytes_turn.proto", package="bench", syntax="proto3"
    )
    msg = file_proto.message_type.add(name="BytesTurn")
    for number, name, kind in (
        (1, "prompt_token_ids", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
        (2, "completion_token_ids", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
        (3, "completion_logprobs", descriptor_pb2.FieldDescriptorProto.TYPE_BYTES),
        (4, "policy_version", descriptor_pb2.FieldDescriptorProto.TYPE_INT64),
    ):
        msg.field.add(
            name=name, number=number, type=kind, label=descriptor_pb2.FieldDescriptorProto.LABEL_OPTIONAL
        )
    batch = file_proto.message_type.add(name="BytesBatch")
    batch.field.add(
        name="turns",
        number=1,
        type=descriptor_pb2.FieldDescriptorProto.TYPE_MESSAGE,
        type_name=".bench.BytesTurn",
        label=descriptor_pb2.FieldDescriptorProto.LABEL_REPEATED,
    )
    pool = descriptor_pool.DescriptorPool()
    pool.Add(file_proto)
    return message_factory.GetMessageClass(pool.FindMessageTypeByName("bench.BytesBatch"))


def _time(fn: Callable[[], object], repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tokens", type=int, default=1_000_000, help="completion tokens in the request")
    args = parser.parse_args()
    turn_len = 1024
    n_turns = max(1, args.tokens // turn_len)
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, 150_000, turn_len, dtype=np.int32) for _ in range(n_turns)]
    completions = [rng.integers(0, 150_000, turn_len, dtype=np.int32) for _ in range(n_turns)]
    logprobs = [(-rng.random(turn_len)).astype(np.float32) for _ in range(n_turns)]
    prompt_lists = [a.tolist() for a in prompts]
    completion_lists = [a.tolist() for a in completions]
    logprob_lists = [a.tolist() for a in logprobs]

    def encode_packed() -> bytes:
        req = trainer_service_pb2.TrainRequest(model="m")
        group = req.groups.add()
        for i in range(n_turns):
            turn = group.trajectories.add(reward=1.0).turns.add(policy_version=3)
            turn.prompt_token_ids.extend(prompt_lists[i])
            turn.completion_token_ids.extend(completion_lists[i])
            turn.completion_logprobs.extend(logprob_lists[i])
        return req.SerializeToString()

    packed_wire = encode_packed()

    def decode_packed() -> list[tuple[list[int], list[int], list[float]]]:
        req = trainer_service_pb2.TrainRequest.FromString(packed_wire)
        return [
            (list(t.prompt_token_ids), list(t.completion_token_ids), list(t.completion_logprobs))
            for traj in req.groups[0].trajectories
            for t in traj.turns
        ]

    def decode_packed_numpy() -> list[np.ndarray]:
        req = trainer_service_pb2.TrainRequest.FromString(packed_wire)
        return [
            np.fromiter(t.completion_token_ids, dtype=np.int32, count=len(t.completion_token_ids))
            for traj in req.groups[0].trajectories
            for t in traj.turns
        ]

    bytes_batch = _bytes_turn_class()

    def encode_bytes() -> bytes:
        batch = bytes_batch()
        for i in range(n_turns):
            batch.turns.add(
                prompt_token_ids=np.asarray(prompt_lists[i], dtype="<i4").tobytes(),
                completion_token_ids=np.asarray(completion_lists[i], dtype="<i4").tobytes(),
                completion_logprobs=np.asarray(logprob_lists[i], dtype="<f4").tobytes(),
                policy_version=3,
            )
        return batch.SerializeToString()

    bytes_wire = encode_bytes()

    def decode_bytes() -> list[tuple[list[int], list[int], list[float]]]:
        batch = bytes_batch.FromString(bytes_wire)
        return [
            (
                np.frombuffer(t.prompt_token_ids, "<i4").tolist(),
                np.frombuffer(t.completion_token_ids, "<i4").tolist(),
                np.frombuffer(t.completion_logprobs, "<f4").tolist(),
            )
            for t in batch.turns
        ]

    assert decode_packed() == decode_bytes()
    rows = [
        ("packed repeated: encode from lists", _time(encode_packed), len(packed_wire)),
        ("packed repeated: decode to lists", _time(decode_packed), len(packed_wire)),
        ("packed repeated: decode to numpy", _time(decode_packed_numpy), len(packed_wire)),
        ("bytes: encode from lists", _time(encode_bytes), len(bytes_wire)),
        ("bytes: decode to lists", _time(decode_bytes), len(bytes_wire)),
    ]
    print(f"{n_turns} turns x {turn_len} prompt + {turn_len} completion tokens (float32 logprobs)")
    print("| step | seconds | wire MB |")
    print("|---|---|---|")
    for name, seconds, size in rows:
        print(f"| {name} | {seconds:.3f} | {size / 1e6:.1f} |")


if __name__ == "__main__":
    main()
