"""Sidecar processes for the tests: `tinkerrpc sidecar` (the real FastAPI app under uvicorn) on 127.0.0.1."""

from __future__ import annotations

from pathlib import Path

import httpx

from tinkerrpc_server.stack import LocalSidecar

API_KEY = "sk-sidecar-test"


class Sidecar(LocalSidecar):
    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


def start_sidecar(grpc_target: str, log_path: Path, api_key: str | None = API_KEY) -> Sidecar:
    return Sidecar(grpc_target, log_path, api_key).start()
