"""The runtime registry: one loaded runtime per base model, and the live training clients (adapters
present in a runtime) with the base model each is on.

Runtimes are loaded and changed on the compute thread only (the runtime is not thread-safe); the live
set is read from any thread.
"""

from __future__ import annotations

import logging
import threading
import time
from pathlib import Path

from tinkerrpc_server.engine.compute.execution_plan import ExecutionPlan
from tinkerrpc_server.engine.compute.scheduler import BatchPolicy
from tinkerrpc_server.engine.runtime import BaseModelRuntime, EngineUserError
from tinkerrpc_server.model_store import listed_builtin_models, resolve_base_model

log = logging.getLogger("tinkerrpc.engine")


class RuntimeRegistry:
    def __init__(
        self,
        model_dir: Path,
        device: str | None,
        dtype: str | None,
        policy: BatchPolicy | None,
        plan: ExecutionPlan,
    ) -> None:
        """Base models are found in (and built-in ones written to) `model_dir`; `device`, `dtype`,
        `policy` and the execution `plan` as in BaseModelRuntime."""
        self.model_dir = model_dir
        self._device, self._dtype, self._policy, self._plan = device, dtype, policy, plan
        self._resolve_lock = threading.Lock()
        self._runtimes: dict[Path, BaseModelRuntime] = {}
        self._live: dict[str, str] = {}  # model_id -> base model

    def supported_models(self) -> list[str]:
        """The built-in models listed before they are built, plus every `<org>/<name>` or `<name>` HF
        directory under the model dir."""
        names = set(listed_builtin_models())
        if self.model_dir.is_dir():
            for config in [*self.model_dir.glob("*/config.json"), *self.model_dir.glob("*/*/config.json")]:
                names.add(str(config.parent.relative_to(self.model_dir)))
        return sorted(names)

    def resolve_model_dir(self, base_model: str) -> Path:
        # The first use of the built-in model writes it to disk; serialize so two threads never race.
        with self._resolve_lock:
            return resolve_base_model(base_model, self.model_dir)

    def runtime(self, base_model: str) -> BaseModelRuntime:
        """The runtime of a base model, loaded on first use (compute thread)."""
        path = self.resolve_model_dir(base_model)
        runtime = self._runtimes.get(path)
        if runtime is None:
            started = time.perf_counter()
            runtime = self._runtimes[path] = BaseModelRuntime(
                path, self._device, self._dtype, self._policy, self._plan
            )
            log.info(
                "loaded base model %s from %s in %.1f s", base_model, path, time.perf_counter() - started
            )
        return runtime

    # ---- live training clients ----

    def live_base_model(self, model_id: str) -> str | None:
        return self._live.get(model_id)

    def live_runtime(self, model_id: str) -> BaseModelRuntime:
        base_model = self._live.get(model_id)
        if base_model is None:
            raise EngineUserError(f"unknown model {model_id!r}")
        return self.runtime(base_model)

    def is_live(self, model_id: str) -> bool:
        return model_id in self._live

    def live_count(self) -> int:
        return len(self._live)

    def live_with_prefix(self, prefix: str) -> list[str]:
        return [model_id for model_id in list(self._live) if model_id.startswith(prefix)]

    def mark_live(self, model_id: str, base_model: str) -> None:
        """`model_id`'s adapter is now in its base model's runtime (compute thread)."""
        self._live[model_id] = base_model

    def unload(self, model_id: str) -> None:
        """Free a live training client's adapter and optimizer state (compute thread)."""
        self.live_runtime(model_id).delete_adapter(model_id)
        del self._live[model_id]
