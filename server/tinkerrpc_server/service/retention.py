"""Retention: what a model's checkpoints may cost on disk, and what its training clients cost in memory.

Per model (CreateModel's keep_* fields, else the server's --keep-sampler-versions / --keep-state-checkpoints):
- sampler checkpoints (vNNNNNN) of the latest N versions stay, plus every version a named state checkpoint
  holds, every version being sampled by a Sample call in flight, and every version a Train names as its
  KL reference or distillation teacher (a reference pin, kept in the store: service/reference_pins.py);
  sampling any other version is NOT_FOUND, as for a deleted one;
- automatic state checkpoints (step_NNNNNN): the latest K stay, plus every named one and the recovery
  point.
The rows go in the transaction that commits the step which made them superfluous, their files after the
step's response (ModelRegistry.tidy_after_commit; through the tinker SDK's RestClient.delete_checkpoint,
like DeleteCheckpoint): a crash in between leaves
files without rows, which `remove_orphans` deletes at the next start, like those of steps that never
committed. Only names of the server's own vNNNNNN/step_NNNNNN pattern in the model's own training runs
are ever deleted that way.

Bytes: the backend reports each checkpoint's size in its checkpoint listing; after each commit the sizes
of the model's new checkpoints are read from it (`record_sizes`, also after the response) and
ModelInfo.checkpoint_bytes sums them (GetModel waits for that).

Memory: a training client the service drops (restore, rollback after a failed or cancelled step,
DeleteModel) is unloaded (`unload_training_client`), so the engine frees its adapter and optimizer state.
"""

from __future__ import annotations

import asyncio
import logging
import re
import sqlite3
from collections import Counter
from collections.abc import Iterator
from contextlib import contextmanager

import tinker
from tinker.lib.client_connection_pool_type import ClientConnectionPoolType

from tinkerrpc_server.service import reference_pins
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.store import ModelRow, Store

log = logging.getLogger("tinkerrpc.service")

# The names the service gives its own automatic checkpoints (models.sampler_name, models.state_name).
_OWN_CHECKPOINT_ID = re.compile(r"(sampler_weights/v|weights/step_)\d{6}")
# How long a best-effort backend call (sizes, unload, listing) may take before it is given up.
_BACKEND_CALL_SECONDS = 30.0


class Retention:
    def __init__(self, store: Store, backend: Backend, limits: Limits) -> None:
        self._store = store
        self._backend = backend
        self._limits = limits
        self._pins: Counter[tuple[str, int]] = Counter()
        self._told_of_path_forms = False

    def policy(self, row: ModelRow) -> tuple[int, int]:
        """(sampler versions kept, automatic state checkpoints kept) for a model."""
        return (
            row.keep_sampler_versions or self._limits.keep_sampler_versions,
            row.keep_state_checkpoints or self._limits.keep_state_checkpoints,
        )

    @contextmanager
    def pinned(self, model: str, version: int) -> Iterator[None]:
        """Keep `version` of `model` sampleable while the block runs (a Sample in flight)."""
        self._pins[(model, version)] += 1
        try:
            yield
        finally:
            self._pins[(model, version)] -= 1
            if self._pins[(model, version)] <= 0:
                del self._pins[(model, version)]

    def prune(self, tx: sqlite3.Connection, row: ModelRow) -> list[str]:
        """Inside the committing transaction: drop the rows the policy no longer keeps; the tinker
        paths to delete once it has committed."""
        keep_samplers, keep_states = self.policy(row)
        pins = {version for (model, version) in self._pins if model == row.name}
        pins |= reference_pins.pinned_versions(tx, row.name)
        return self._store.prune(tx, row.name, keep_samplers, keep_states, pins)

    async def record_sizes(self, model: str, run_id: str) -> None:
        """Best effort: the sizes of the model's checkpoints in `run_id` that are not known yet."""
        unsized = set(self._store.unsized_paths(model))
        if not unsized:
            return
        try:
            listing = await asyncio.wait_for(
                self._backend.rest.list_checkpoints(run_id), _BACKEND_CALL_SECONDS
            )
        except Exception as err:
            log.warning("model %s: could not read checkpoint sizes from run %s: %s", model, run_id, err)
            return
        sizes = {
            c.tinker_path: c.size_bytes
            for c in listing.checkpoints
            if c.tinker_path in unsized and c.size_bytes is not None
        }
        if sizes:
            self._store.set_sizes(model, sizes)

    async def orphans(self, row: ModelRow, known_paths: set[str]) -> list[str]:
        """The server-named checkpoints in the model's training runs that no row references: saved by
        steps that never committed, or pruned by one whose file deletion a crash interrupted."""
        run_ids = {row.tinker_run_id} | {
            c.tinker_path.removeprefix("tinker://").split("/")[0]
            for c in self._store.list_checkpoints(row.name)
        }
        found: list[str] = []
        for run_id in sorted(run_ids - {""}):
            try:
                listing = await asyncio.wait_for(
                    self._backend.rest.list_checkpoints(run_id), _BACKEND_CALL_SECONDS
                )
            except Exception as err:
                log.warning("model %s: could not list run %s for orphans: %s", row.name, run_id, err)
                continue
            found.extend(
                c.tinker_path
                for c in listing.checkpoints
                if c.tinker_path not in known_paths and _OWN_CHECKPOINT_ID.fullmatch(c.checkpoint_id)
            )
        return found

    async def delete_path(self, path: str) -> None:
        """Delete one checkpoint; a path the backend refuses (its save answers may name checkpoints in
        another form than its listing does) is retried with the listing's path of the same checkpoint,
        and that is logged once per server, not at every step. Raises what the last attempt raised."""
        try:
            await self._backend.rest.delete_checkpoint_from_tinker_path(path)
            return
        except Exception as refused:
            listed = await self._listed_path_of(path)
            if listed is None or listed == path:
                raise
            if not self._told_of_path_forms:
                self._told_of_path_forms = True
                log.warning(
                    "the backend refused to delete %s (%s); deleting by the path its listing gives, %s, "
                    "from now on (logged once)",
                    path,
                    refused,
                    listed,
                )
        await self._backend.rest.delete_checkpoint_from_tinker_path(listed)

    async def _listed_path_of(self, path: str) -> str | None:
        """The listing's path of the checkpoint `path` names: same run, same `<kind>/<name>` id."""
        run_id, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
        if not run_id or not checkpoint_id:
            return None
        try:
            listing = await asyncio.wait_for(
                self._backend.rest.list_checkpoints(run_id), _BACKEND_CALL_SECONDS
            )
        except Exception as err:
            log.warning("could not list run %s to find %s: %s", run_id, path, err)
            return None
        return next((c.tinker_path for c in listing.checkpoints if c.checkpoint_id == checkpoint_id), None)


def unload_training_client(client: tinker.TrainingClient) -> None:
    """Best effort, in the background (no call waits on it: a backend that stopped answering must not hold
    a Train past its deadline): ask the backend to free a training client the service no longer uses. The
    SDK has no public method for the Tinker API's unload_model request; its own HTTP client sends it."""
    task = asyncio.create_task(_unload(client))
    _unloading.add(task)  # the loop keeps only weak references to tasks
    task.add_done_callback(_unloading.discard)


_unloading: set[asyncio.Task[None]] = set()


async def _unload(client: tinker.TrainingClient) -> None:
    request = tinker.types.UnloadModelRequest(model_id=client.model_id)

    async def send() -> None:
        with client.holder.aclient(ClientConnectionPoolType.TRAIN) as http:
            await http.post(
                "/api/v1/unload_model",
                body=request.model_dump(mode="json"),
                cast_to=tinker.types.UntypedAPIFuture,
            )

    try:
        await asyncio.wait_for(client.holder.run_coroutine_threadsafe(send()), _BACKEND_CALL_SECONDS)
    except Exception as err:
        log.warning("could not unload training client %s: %s", client.model_id, err)
