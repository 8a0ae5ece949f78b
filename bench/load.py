"""Load: N concurrent samplers and one trainer drive one model for a bounded time over gRPC on 127.0.0.1.

    python -m bench.load --seconds 20 --samplers 4            # against a fresh local stack
    python -m bench.load --target 127.0.0.1:50051 --json      # against a running server

Samplers call Sample (latest policy version) back to back; the trainer samples a group, trains one RL step
on it (rewards spread so the group always has variance) and repeats, so sampling runs across version
changes. Reports requests, errors and p50/p99 latency per RPC (markdown table, or JSON with --json); exits 1
when any call failed: zero errors are expected. Calls go through plain gRPC stubs, without the SDK's
retries, so every failure counts.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import math
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import grpc

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2
from tinkerrpc_server.local.stack import LocalStack

BASE_MODEL = "tinkerrpc/tiny-chat"
PROMPTS = ("respond with yes", "respond with no", "say maybe", "answer briefly")
GROUP_SIZE = 4
CALL_TIMEOUT = 120.0


@dataclass
class RpcStats:
    latencies: list[float] = field(default_factory=list)
    errors: dict[str, int] = field(default_factory=dict)

    @property
    def requests(self) -> int:
        return len(self.latencies) + sum(self.errors.values())

    def percentile(self, q: float) -> float:
        """Nearest-rank percentile of the successful calls' latencies, in seconds (nan when none)."""
        if not self.latencies:
            return math.nan
        ordered = sorted(self.latencies)
        return ordered[min(len(ordered) - 1, max(0, math.ceil(q / 100 * len(ordered)) - 1))]


@dataclass
class LoadResult:
    seconds: float
    samplers: int
    final_version: int
    stats: dict[str, RpcStats]

    @property
    def errors(self) -> int:
        return sum(sum(s.errors.values()) for s in self.stats.values())

    def as_dict(self) -> dict[str, Any]:
        return {
            "seconds": round(self.seconds, 2),
            "samplers": self.samplers,
            "final_policy_version": self.final_version,
            "errors": self.errors,
            "rpcs": {
                name: {
                    "requests": s.requests,
                    "errors": s.errors,
                    "p50_ms": round(s.percentile(50) * 1000, 1),
                    "p99_ms": round(s.percentile(99) * 1000, 1),
                    "per_second": round(len(s.latencies) / self.seconds, 2),
                }
                for name, s in self.stats.items()
            },
        }

    def markdown(self) -> str:
        lines = [
            f"Load: {self.samplers} samplers + 1 trainer for {self.seconds:.1f} s, "
            f"final policy version {self.final_version}",
            "",
            "| RPC | requests | errors | p50 ms | p99 ms | ok/s |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for name, s in self.stats.items():
            lines.append(
                f"| {name} | {s.requests} | {sum(s.errors.values())} | {s.percentile(50) * 1000:.1f} | "
                f"{s.percentile(99) * 1000:.1f} | {len(s.latencies) / self.seconds:.2f} |"
            )
        failures = {f"{name} {code}": n for name, s in self.stats.items() for code, n in s.errors.items()}
        if failures:
            lines += ["", "Errors: " + ", ".join(f"{key} x{n}" for key, n in failures.items())]
        return "\n".join(lines)


class _Driver:
    def __init__(
        self,
        stub: trainer_service_pb2_grpc.TrainerServiceStub,
        model: str,
        max_tokens: int,
        metadata: tuple[tuple[str, str], ...] | None,
    ) -> None:
        self.stub = stub
        self.metadata = metadata
        self.model = model
        self.max_tokens = max_tokens
        self.stats = {"Sample": RpcStats(), "Train": RpcStats()}

    async def timed(self, rpc: str, call: Callable[[], Awaitable[Any]]) -> Any | None:
        started = time.perf_counter()
        try:
            response = await call()
        except grpc.aio.AioRpcError as err:
            code = err.code().name
            self.stats[rpc].errors[code] = self.stats[rpc].errors.get(code, 0) + 1
            return None
        self.stats[rpc].latencies.append(time.perf_counter() - started)
        return response

    def sample_request(self, prompt: str, n: int, seed: int) -> pb.SampleRequest:
        return pb.SampleRequest(
            model=self.model,
            chat=pb.ChatPrompt(messages=[types_pb2.Message(role=types_pb2.ROLE_USER, content=prompt)]),
            params=types_pb2.SamplingParams(n=n, max_tokens=self.max_tokens, seed=seed),
        )

    async def sampler(self, index: int, deadline: float) -> None:
        calls = 0
        while time.monotonic() < deadline:
            request = self.sample_request(PROMPTS[(index + calls) % len(PROMPTS)], 1, index * 100_000 + calls)
            await self.timed(
                "Sample",
                functools.partial(self.stub.Sample, request, timeout=CALL_TIMEOUT, metadata=self.metadata),
            )
            calls += 1

    async def trainer(self, deadline: float) -> None:
        step = 0
        while time.monotonic() < deadline:
            request = self.sample_request(PROMPTS[step % len(PROMPTS)], GROUP_SIZE, 7_000_000 + step)
            sample = await self.timed(
                "Sample",
                functools.partial(self.stub.Sample, request, timeout=CALL_TIMEOUT, metadata=self.metadata),
            )
            if sample is None:
                continue
            train = pb.TrainRequest(
                model=self.model,
                adam=types_pb2.AdamParams(learning_rate=1e-3),
                idempotency_key=f"load-{time.time_ns()}-{step}",
            )
            group = train.groups.add()
            for i, sequence in enumerate(sample.sequences):
                trajectory = group.trajectories.add(reward=i / GROUP_SIZE)
                trajectory.turns.add(
                    prompt_token_ids=sample.prompt_token_ids,
                    completion_token_ids=sequence.token_ids,
                    completion_logprobs=sequence.logprobs,
                    policy_version=sequence.policy_version,
                )
            await self.timed(
                "Train",
                functools.partial(self.stub.Train, train, timeout=CALL_TIMEOUT, metadata=self.metadata),
            )
            step += 1


async def run_load(
    target: str,
    seconds: float,
    samplers: int,
    model: str = "load",
    max_tokens: int = 8,
    token: str | None = None,
) -> LoadResult:
    """Drive `model` on the server at `target` (created on tiny-chat when missing) for `seconds`."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    async with grpc.aio.insecure_channel(target) as channel:
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        try:
            await stub.CreateModel(
                pb.CreateModelRequest(name=model, base_model=BASE_MODEL, lora=types_pb2.LoraConfig(rank=8)),
                timeout=CALL_TIMEOUT,
                metadata=metadata,
            )
        except grpc.aio.AioRpcError as err:
            if err.code() != grpc.StatusCode.ALREADY_EXISTS:
                raise
        driver = _Driver(stub, model, max_tokens, metadata)
        started = time.monotonic()
        deadline = started + seconds
        await asyncio.gather(
            driver.trainer(deadline), *(driver.sampler(i, deadline) for i in range(samplers))
        )
        elapsed = time.monotonic() - started
        info = await stub.GetModel(pb.GetModelRequest(name=model), timeout=CALL_TIMEOUT, metadata=metadata)
        return LoadResult(elapsed, samplers, info.model.policy_version, driver.stats)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.load", description=__doc__.split("\n")[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="how long to drive the load")
    parser.add_argument("--samplers", type=int, default=4, help="concurrent sampling loops")
    parser.add_argument("--max-tokens", type=int, default=8, help="max_tokens of each sample")
    parser.add_argument("--model", default="load", help="model to drive (created when missing)")
    parser.add_argument("--target", default=None, help="a running tinkerrpc server (default: start one)")
    parser.add_argument("--token", default=None, help="bearer token of --target")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a markdown table")
    args = parser.parse_args(argv)
    if args.seconds <= 0 or args.samplers < 0 or args.max_tokens < 1:
        parser.error("--seconds > 0, --samplers >= 0 and --max-tokens >= 1 are required")

    def drive(target: str) -> LoadResult:
        return asyncio.run(
            run_load(target, args.seconds, args.samplers, args.model, args.max_tokens, args.token)
        )

    if args.target:
        result = drive(args.target)
    else:
        with (
            tempfile.TemporaryDirectory(prefix="tinkerrpc-load-") as tmp,
            LocalStack(Path(tmp) / "data", Path(tmp) / "serve.log") as stack,
        ):
            result = drive(stack.target)
    print(json.dumps(result.as_dict(), indent=2) if args.json else result.markdown())
    return 1 if result.errors else 0


if __name__ == "__main__":
    sys.exit(main())
