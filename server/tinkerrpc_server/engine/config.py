"""How one engine is configured: `EngineConfig`, built once by its entry point (the `tinkerrpc engine`
command, `serve`'s engine child, the bench's gather-then-run baseline) and read by everything it starts.

Light imports only: the CLI builds and checks it before it imports torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from tinkerrpc_server.engine.auth import api_key_problem, is_loopback_host
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV, ENGINE_DTYPES, KernelSettings, Settings

if TYPE_CHECKING:
    from tinkerrpc_server.engine.compute.scheduler import BatchPolicy

# A session whose client sent nothing for this long is finished: the tinker SDK heartbeats every 10 s
# and warns "the session will be terminated" after 120 s without one. A client killed mid-run (or one
# that never closes its ServiceClient, like the cookbook's loops) frees what it made after this.
DEFAULT_SESSION_TIMEOUT_SECONDS = 120.0
# Above the SDK's heartbeat interval, or a live client's session would be finished between two beats.
MIN_SESSION_TIMEOUT_SECONDS = 10.0
MAX_SESSION_TIMEOUT_SECONDS = 86400.0
# How long a superseded unnamed sampler snapshot stays after its last sampling session or request let go
# of it: a rollout holding a sampling client between requests (the SDK keeps no session per client)
# still finds its weights.
DEFAULT_SNAPSHOT_GRACE_SECONDS = 10.0
MAX_SNAPSHOT_GRACE_SECONDS = 3600.0


class EngineConfigError(ValueError):
    """A configuration value the engine cannot run with; the message names it and its range."""


@dataclass(frozen=True)
class EngineConfig:
    """One engine's configuration, checked when it is made (EngineConfigError)."""

    data_dir: Path
    model_dir: Path
    # The key every request but the health check and signed downloads must carry (X-API-Key, the tinker
    # SDK's api_key); None only with `insecure_no_auth`.
    api_key: str | None = None
    # Serve anyone who reaches the port: allowed on a loopback host only.
    insecure_no_auth: bool = False
    host: str = "127.0.0.1"
    port: int = 0  # 0: one the system picks
    session_timeout: float = DEFAULT_SESSION_TIMEOUT_SECONDS
    # Torch device and base-weight dtype (None: the default; engine/compute/placement.py). Whether this
    # machine has the device is checked when the engine starts (it needs torch).
    device: str | None = None
    dtype: str | None = None
    # How the samples of one base model are batched (None: continuous batching).
    policy: BatchPolicy | None = None
    snapshot_grace: float = DEFAULT_SNAPSHOT_GRACE_SECONDS
    # Threads torch's parallel ops use on the compute thread (None: as many as the process has).
    torch_threads: int | None = None
    # Seconds to wait for an engine that still owns the data dir to exit (a restarted child's predecessor
    # may still be unmapping a large model).
    ownership_patience: float = 0.0
    # Whether the engine's CPU kernels may run and where their build is cached (the settings'): the
    # engine chooses its execution plan from them when it starts (compute/execution_plan.py).
    kernels: KernelSettings = field(default_factory=KernelSettings)

    @classmethod
    def from_settings(
        cls,
        settings: Settings,
        data_dir: Path,
        model_dir: Path,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        policy: BatchPolicy | None = None,
        ownership_patience: float = 0.0,
    ) -> EngineConfig:
        """An engine as the process's settings describe it (key, device, dtype, kernels): how a started
        child or a bench baseline is configured, where the CLI's flags have no say."""
        return cls(
            data_dir=data_dir,
            model_dir=model_dir,
            api_key=settings.engine_api_key,
            host=host,
            port=port,
            device=settings.engine_device,
            dtype=settings.engine_dtype,
            policy=policy,
            ownership_patience=ownership_patience,
            kernels=settings.kernels,
        )

    def __post_init__(self) -> None:
        problem = self._problem()
        if problem is not None:
            raise EngineConfigError(problem)

    def _problem(self) -> str | None:
        if self.insecure_no_auth and self.api_key is not None:
            return "insecure_no_auth contradicts the API key given"
        if self.api_key is None and not self.insecure_no_auth:
            return f"no API key (${ENGINE_API_KEY_ENV}); serving without one needs insecure_no_auth"
        key_problem = None if self.api_key is None else api_key_problem(self.api_key)
        if key_problem is not None:
            return key_problem
        if self.api_key is None and not is_loopback_host(self.host):
            return f"an engine without an API key serves a loopback host only, not {self.host!r}"
        if not 0 <= self.port <= 65535:
            return f"port must be 0 to 65535 (0: one the system picks), got {self.port}"
        if not MIN_SESSION_TIMEOUT_SECONDS < self.session_timeout <= MAX_SESSION_TIMEOUT_SECONDS:
            return (
                f"session timeout must be above the SDK's {MIN_SESSION_TIMEOUT_SECONDS:g} s heartbeat and "
                f"at most a day ({MAX_SESSION_TIMEOUT_SECONDS:g} s), got {self.session_timeout}"
            )
        if not 0 < self.snapshot_grace <= MAX_SNAPSHOT_GRACE_SECONDS:
            return f"snapshot grace must be in (0, {MAX_SNAPSHOT_GRACE_SECONDS:g}] seconds, got {self.snapshot_grace}"
        if self.dtype is not None and self.dtype not in ENGINE_DTYPES:
            return f"engine dtype {self.dtype!r}: expected one of {', '.join(ENGINE_DTYPES)}"
        if self.torch_threads is not None and self.torch_threads < 1:
            return f"torch threads must be at least 1, got {self.torch_threads}"
        if not 0 <= self.ownership_patience < math.inf:
            return (
                f"ownership patience must be a finite number of seconds >= 0, got {self.ownership_patience}"
            )
        return None
