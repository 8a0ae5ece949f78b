"""ExportWeights: the adapter of the current or an earlier version in the backend's external (PEFT)
format, downloaded from the backend into a local directory and streamed in chunks."""

from __future__ import annotations

import logging
import tempfile
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import tinker

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.models import VERSION_RESOURCE, ModelRegistry, made_or_freed
from tinkerrpc_server.service.retention import unload_training_client
from tinkerrpc_server.service.store import KIND_STATE, ModelRow, Store
from tinkerrpc_server.service.validation import check_expected_version, check_export_request

log = logging.getLogger("tinkerrpc.service")

# ExportWeights streams files in pieces of this size.
EXPORT_CHUNK_BYTES = 1 << 20
# Longest a single exported file may take to come from the backend.
EXPORT_DOWNLOAD_TIMEOUT_SECONDS = 600.0


@dataclass
class Export:
    """An export fetched from the backend into a local directory, ready to stream."""

    weights: types_pb2.ExportedWeights
    directory: tempfile.TemporaryDirectory[str]

    def responses(self) -> Iterator[pb.ExportWeightsResponse]:
        """The weights' description, then each file's chunks (the caller holds the directory open)."""
        yield pb.ExportWeightsResponse(weights=self.weights)
        for file in self.weights.files:
            with open(Path(self.directory.name) / file.path, "rb") as handle:
                offset = 0
                while data := handle.read(EXPORT_CHUNK_BYTES):
                    yield pb.ExportWeightsResponse(
                        chunk=types_pb2.FileChunk(path=file.path, offset=offset, data=data)
                    )
                    offset += len(data)


async def _download(http: httpx.AsyncClient, url: str, directory: Path, relative: str) -> int:
    """Stream one exported file from the backend to `directory`/`relative`; its size."""
    target = (directory / relative).resolve()
    if not target.is_relative_to(directory.resolve()):
        raise ServiceError(grpc.StatusCode.INTERNAL, f"the backend exported an unsafe file path {relative!r}")
    target.parent.mkdir(parents=True, exist_ok=True)
    size = 0
    async with http.stream("GET", url) as response:
        if response.status_code != 200:
            raise ServiceError(
                grpc.StatusCode.UNAVAILABLE,
                f"downloading exported file {relative!r} from the backend failed: HTTP {response.status_code}",
            )
        with open(target, "wb") as handle:
            async for data in response.aiter_bytes(EXPORT_CHUNK_BYTES):
                handle.write(data)
                size += len(data)
    return size


class Exporter:
    def __init__(self, store: Store, backend: Backend, models: ModelRegistry) -> None:
        self._store = store
        self._backend = backend
        self._models = models

    async def fetch(self, request: pb.ExportWeightsRequest) -> Export:
        """Saves the adapter in the backend's external format, downloads its files from the backend's
        (signed) URLs into a local temporary directory, and deletes the backend's copy."""
        runtime = self._models.runtime(request.model)
        check_export_request(request)
        async with runtime.lock:
            row = self._models.row(request.model)
            check_expected_version(row, request)
            version = request.policy_version if request.HasField("policy_version") else row.policy_version
            name = f"export-{version:06d}-{uuid.uuid4().hex[:8]}"
            if version == row.policy_version:
                path = await self._save_external(await self._models.training_client(row.name, runtime), name)
            else:
                path = await self._export_earlier_version(row, version, name)
        directory = tempfile.TemporaryDirectory(prefix="tinkerrpc-export-")
        try:
            try:
                urls = (await self._backend.rest.get_external_weights_urls(path)).urls
            except tinker.NotFoundError as err:
                raise self._no_external_export("get_external_weights_urls", err) from None
            async with httpx.AsyncClient(timeout=EXPORT_DOWNLOAD_TIMEOUT_SECONDS) as http:
                files = [
                    types_pb2.ExportedFile(
                        path=relative, size_bytes=await _download(http, url, Path(directory.name), relative)
                    )
                    for relative, url in sorted(urls.items())
                ]
        except BaseException:
            directory.cleanup()
            raise
        finally:
            await self._discard_backend_export(path)
        log.info("model %s: exported version %d (%d files)", row.name, version, len(files))
        weights = types_pb2.ExportedWeights(
            model=row.name, policy_version=version, base_model=row.base_model, files=files
        )
        return Export(weights, directory)

    async def _export_earlier_version(self, row: ModelRow, version: int, name: str) -> str:
        """Export `version` < the current one without moving the model: a training client of its own,
        made from that version's state checkpoint (its weights), exports it and is unloaded."""
        resource = f"{row.name}@{version}"
        if version > row.policy_version:
            raise errors.not_found(
                VERSION_RESOURCE, resource, f"model {row.name!r} is at version {row.policy_version}"
            )
        state = next(
            (
                c
                for c in self._store.list_checkpoints(row.name)
                if c.kind == KIND_STATE and c.policy_version == version
            ),
            None,
        )
        if state is None:
            raise errors.not_found(
                VERSION_RESOURCE,
                resource,
                f"model {row.name!r} has no state checkpoint at version {version} to export it from",
            )
        client = await made_or_freed(
            self._backend.service.create_training_client_from_state(state.tinker_path),
            "loading the version to export",
        )
        try:
            return await self._save_external(client, name)
        finally:
            unload_training_client(client)

    async def _save_external(self, client: tinker.TrainingClient, name: str) -> str:
        try:
            saved: tinker.types.SaveWeightsExternalResponse = await client.save_weights_external(name)
        except tinker.NotFoundError as err:
            raise self._no_external_export("save_weights_external", err) from None
        return saved.path

    def _no_external_export(self, route: str, err: tinker.NotFoundError) -> ServiceError:
        """A Tinker-compatible backend without Tinker's external-weights export (it answers its route
        404): one line saying so, instead of the SDK's error."""
        return ServiceError(
            grpc.StatusCode.UNIMPLEMENTED,
            f"ExportWeights needs the Tinker backend at {self._backend.url} to export adapters "
            f"(save_weights_external) with download URLs (get_external_weights_urls); its {route} "
            f"answered {err.status_code}. The model's checkpoints stay on the backend (ListCheckpoints)",
        )

    async def _discard_backend_export(self, path: str) -> None:
        try:
            await self._backend.rest.delete_checkpoint_from_tinker_path(path)
        except Exception as err:  # a stray backend copy only costs space: never fail the export for it
            log.warning("could not delete the backend's export %s: %s", path, err)
