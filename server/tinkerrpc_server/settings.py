"""What every `tinkerrpc` process takes from its environment, read once at its entry point (the CLI's
commands, the engine child) into one `Settings` and passed down; the environment its children start
with; the defaults it sets before heavy imports; and its log format.

The only module that reads or writes the process environment. A module of its own, below everything
else, because its readers sit at different layers: the CLI, the server, the local harness (`local/`)
and the engine child.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from tinkerrpc.settings import (
    SIDECAR_API_KEY_ENV as SIDECAR_API_KEY_ENV,  # re-exported: one name for both sides
)

AUTH_TOKEN_ENV = "TINKERRPC_AUTH_TOKEN"
# The key the engine requires as X-API-Key: `serve` hands its engine child a fresh one here (never on
# the command line, which every user of the machine can read); `tinkerrpc engine` reads it too.
ENGINE_API_KEY_ENV = "TINKERRPC_ENGINE_API_KEY"
LOG_LEVEL_ENV = "TINKERRPC_LOG_LEVEL"
MODEL_DIR_ENV = "TINKERRPC_MODEL_DIR"
# The embedded engine's torch device ("cpu", "cuda", "cuda:1"; unset: CUDA when there is one) and the
# dtype of its base weights ("float32" or "bfloat16"; unset: bfloat16 on CUDA, float32 on CPU); LoRA
# weights and optimizer state are float32 either way (docs/devices.md). `serve`'s engine child and every
# engine a harness starts inherit them; `tinkerrpc engine --device/--dtype` override them.
ENGINE_DEVICE_ENV = "TINKERRPC_ENGINE_DEVICE"
ENGINE_DTYPE_ENV = "TINKERRPC_ENGINE_DTYPE"
ENGINE_DTYPES = ("float32", "bfloat16")
TINKER_API_KEY_ENV = "TINKER_API_KEY"
TINKER_BASE_URL_ENV = "TINKER_BASE_URL"

# The engine's fused CPU kernels (engine/compute/cpu_kernels.py): "0" turns them off (to measure what
# they change), "1" (the default) uses them where they build; their build is cached in the kernels dir,
# compiled by $CXX (default g++).
CPU_KERNELS_ENV = "TINKERRPC_CPU_KERNELS"
KERNELS_DIR_ENV = "TINKERRPC_KERNELS_DIR"
COMPILER_ENV = "CXX"

LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
DEFAULT_MODEL_DIR = Path("~/.cache/tinkerrpc/models").expanduser()
DEFAULT_KERNELS_DIR = Path("~/.cache/tinkerrpc/cpu-kernels").expanduser()

# Credentials a child never inherits: each child that needs one is handed it explicitly.
_SECRET_ENVS = (AUTH_TOKEN_ENV, SIDECAR_API_KEY_ENV, ENGINE_API_KEY_ENV)


class SettingsError(ValueError):
    """An environment variable holds a value tinkerrpc cannot use."""


@dataclass(frozen=True)
class KernelSettings:
    """Whether the engine may run its own CPU kernels, where their build is cached, and what compiles it."""

    enabled: bool = True
    build_dir: Path = DEFAULT_KERNELS_DIR
    compiler: str = "g++"


@dataclass(frozen=True)
class Settings:
    """The environment a process was started with, as tinkerrpc reads it. Unset and empty are alike."""

    log_level: str = "INFO"
    # The gRPC server's bearer token (`serve`'s default, and what client commands send).
    auth_token: str | None = None
    sidecar_api_key: str | None = None
    engine_api_key: str | None = None
    model_dir: Path = DEFAULT_MODEL_DIR
    engine_device: str | None = None
    engine_dtype: str | None = None
    # Tinker itself serves instead of the embedded engine when its key is set.
    tinker_api_key: str | None = None
    tinker_base_url: str | None = None
    kernels: KernelSettings = KernelSettings()

    @classmethod
    def from_environment(cls, environ: Mapping[str, str] | None = None) -> Settings:
        env = os.environ if environ is None else environ

        def read(name: str) -> str | None:
            return env.get(name, "").strip() or None

        log_level = (read(LOG_LEVEL_ENV) or "INFO").upper()
        if log_level not in LOG_LEVELS:
            raise SettingsError(f"${LOG_LEVEL_ENV} must be one of {', '.join(LOG_LEVELS)}, not {log_level!r}")
        model_dir = read(MODEL_DIR_ENV)
        kernels_switch = read(CPU_KERNELS_ENV) or "1"
        if kernels_switch not in ("0", "1"):
            raise SettingsError(f"${CPU_KERNELS_ENV} must be 0 (off) or 1 (on), not {kernels_switch!r}")
        kernels_dir = read(KERNELS_DIR_ENV)
        return cls(
            log_level=log_level,
            auth_token=read(AUTH_TOKEN_ENV),
            sidecar_api_key=read(SIDECAR_API_KEY_ENV),
            engine_api_key=read(ENGINE_API_KEY_ENV),
            model_dir=Path(model_dir).expanduser() if model_dir else DEFAULT_MODEL_DIR,
            engine_device=read(ENGINE_DEVICE_ENV),
            engine_dtype=read(ENGINE_DTYPE_ENV),
            tinker_api_key=read(TINKER_API_KEY_ENV),
            tinker_base_url=read(TINKER_BASE_URL_ENV),
            kernels=KernelSettings(
                enabled=kernels_switch == "1",
                build_dir=Path(kernels_dir).expanduser() if kernels_dir else DEFAULT_KERNELS_DIR,
                compiler=read(COMPILER_ENV) or "g++",
            ),
        )


def settings_of(program: str) -> Settings | None:
    """This process's settings, or None once `program` has printed why its environment is unusable."""
    try:
        return Settings.from_environment()
    except SettingsError as err:
        print(f"{program}: {err}", file=sys.stderr)
        return None


def forget_engine_api_key() -> None:
    """Drop the engine key from this process's environment once read, so nothing it starts inherits it."""
    os.environ.pop(ENGINE_API_KEY_ENV, None)


def child_environment(handed: Mapping[str, str] | None = None) -> dict[str, str]:
    """The environment of a child process: this one's without any credential, with telemetry off, and
    with `handed` on top (the credentials that child needs, and whatever its starter sets)."""
    env = {name: value for name, value in os.environ.items() if name not in _SECRET_ENVS}
    env["TINKER_TELEMETRY"] = "0"
    env.update(handed or {})
    return env


def set_process_defaults() -> None:
    """Environment defaults for this process and its children; call before torch or tinker is imported."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # libgomp's workers spin ~300k times waiting for the next parallel region; on cores shared by the
    # engine, the server and rollout workers, those spins steal the time the others need. Never spinning
    # (OMP_WAIT_POLICY=PASSIVE) slows a decode step, whose ops follow each other within microseconds; a
    # short spin keeps the workers awake between ops and asleep soon after. Read when torch loads.
    if "OMP_WAIT_POLICY" not in os.environ:
        os.environ.setdefault("GOMP_SPINCOUNT", "20000")


def configure_logging(level: str) -> None:
    logging.basicConfig(
        level=level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s", stream=sys.stderr
    )
