"""Shared by the hardening tests (a uniquely named module: every test directory has its own conftest)."""

from __future__ import annotations

from dataclasses import dataclass

from service.svc import Server

SIDECAR_KEY = "campaign-sidecar-key"
MAX_SAMPLE_N = 8
MAX_SAMPLE_TOKENS = 64
MAX_TRAIN_TRAJECTORIES = 16
MAX_TRAIN_TOKENS = 3000


@dataclass(frozen=True)
class HostedServer:
    server: Server
    sidecar_url: str
