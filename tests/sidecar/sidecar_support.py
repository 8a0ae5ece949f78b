"""Sidecar processes for the tests: `tinkerrpc sidecar` (the real FastAPI app under uvicorn) on 127.0.0.1."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai

import tinkerrpc
from tinkerrpc_server.local.stack import LocalSidecar

API_KEY = "sk-sidecar-test"


class Sidecar(LocalSidecar):
    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


def start_sidecar(grpc_target: str, log_path: Path, api_key: str | None = API_KEY) -> Sidecar:
    return Sidecar(grpc_target, log_path, api_key).start()


@dataclass
class Stack:
    """`tinkerrpc serve` (embedded engine) with a sidecar in front, and an SDK client on the server."""

    grpc_target: str
    sidecar: Sidecar
    client: tinkerrpc.Client

    def openai(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.sidecar.openai_base_url, api_key=API_KEY, max_retries=0, **options)

    def async_openai(self) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(base_url=self.sidecar.openai_base_url, api_key=API_KEY, max_retries=0)
