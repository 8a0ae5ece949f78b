"""The process settings every `tinkerrpc` process shares: the environment variables it reads, the
defaults it sets before heavy imports, and its log format.

A module of its own, below everything else, because its readers sit at different layers: the CLI takes
its defaults from these variables, the local harness (`local/`) sets them for the processes it starts,
and the engine child starts without the CLI. Not `auth.py`: that is the gRPC server's token check, and
the sidecar's key has nothing to do with it.
"""

from __future__ import annotations

import logging
import os
import sys

AUTH_TOKEN_ENV = "TINKERRPC_AUTH_TOKEN"
SIDECAR_API_KEY_ENV = "TINKERRPC_SIDECAR_API_KEY"
# The key the engine requires as X-API-Key: `serve` hands its engine child a fresh one here (never on
# the command line, which every user of the machine can read); `tinkerrpc engine` reads it too.
ENGINE_API_KEY_ENV = "TINKERRPC_ENGINE_API_KEY"
LOG_LEVEL_ENV = "TINKERRPC_LOG_LEVEL"
# The embedded engine's torch device ("cpu", "cuda", "cuda:1"; unset: CUDA when there is one) and the
# dtype of its base weights ("float32" or "bfloat16"; unset: bfloat16 on CUDA, float32 on CPU); LoRA
# weights and optimizer state are float32 either way (docs/devices.md). Read by the engine when it loads a
# base model, so `serve`'s engine child and every engine a harness starts inherit them; `tinkerrpc
# engine --device/--dtype` set them.
ENGINE_DEVICE_ENV = "TINKERRPC_ENGINE_DEVICE"
ENGINE_DTYPE_ENV = "TINKERRPC_ENGINE_DTYPE"
ENGINE_DTYPES = ("float32", "bfloat16")


def set_process_defaults() -> None:
    """Environment defaults for this process and its children; call before torch or tinker is imported."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # libgomp's workers spin ~300k times waiting for the next parallel region: on shared cores (engine,
    # server, rollout workers on one machine) they collapse (tiny engine steps under two busy loops:
    # 221 ms median, 607 ms max, vs 83 ms never spinning). Never spinning (OMP_WAIT_POLICY=PASSIVE)
    # costs ~13% of a decode step, whose ops follow each other within microseconds. A short spin keeps
    # the workers awake between ops and asleep soon after: 68 ms under the same load, and the
    # staggered-arrivals figure 553-581 vs 495-501 tok/s. Read when torch loads; the engine inherits it.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def default_log_level() -> str:
    return os.environ.get(LOG_LEVEL_ENV, "INFO")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
