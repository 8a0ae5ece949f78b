"""Receiving ExportWeights: the streamed adapter files become a directory that appears only once whole."""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path, PurePosixPath

from tinkerrpc._progress import ProgressBar
from tinkerrpc._types import ExportedWeights
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

MIB = 1 << 20


class ExportProtocolError(RuntimeError):
    """The server's ExportWeights stream broke its contract (order, paths, offsets or sizes)."""


def check_export_target(directory: Path) -> None:
    """Refuse, before any network call, to export over existing files."""
    if directory.exists() and (not directory.is_dir() or any(directory.iterdir())):
        raise FileExistsError(f"{directory} exists and is not an empty directory")


def _safe_relative(path: str) -> PurePosixPath:
    relative = PurePosixPath(path)
    if not path or relative.is_absolute() or ".." in relative.parts or "\\" in path:
        raise ExportProtocolError(f"the server sent an unsafe file path {path!r}")
    return relative


class WeightsWriter:
    """Writes one attempt's stream into a staging directory beside `directory`; `finish()` checks every
    file is complete and renames the staging directory into place, `discard()` removes it."""

    def __init__(self, directory: Path, progress: bool = False) -> None:
        self.directory = directory
        self.progress = progress
        directory.parent.mkdir(parents=True, exist_ok=True)
        self._staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.partial-", dir=directory.parent))
        self._weights: pb.ExportedWeights | None = None
        self._written: dict[str, int] = {}
        self._bar: ProgressBar | None = None

    def add(self, response: service_pb.ExportWeightsResponse) -> None:
        part = response.WhichOneof("part")
        if part == "weights":
            if self._weights is not None:
                raise ExportProtocolError("the server described the export twice")
            self._weights = response.weights
            self._written = {_safe_relative(f.path).as_posix(): 0 for f in response.weights.files}
            if self.progress:
                total = sum(f.size_bytes for f in response.weights.files)
                self._bar = ProgressBar(
                    total, f"export {response.weights.model}@{response.weights.policy_version}"
                )
                self._draw()
            return
        if part != "chunk" or self._weights is None:
            raise ExportProtocolError("a file chunk came before the export's description")
        chunk = response.chunk
        path = _safe_relative(chunk.path).as_posix()
        if path not in self._written:
            raise ExportProtocolError(f"a chunk of {path!r}, which the export does not list")
        if chunk.offset != self._written[path]:
            raise ExportProtocolError(
                f"{path!r}: a chunk at offset {chunk.offset}, expected {self._written[path]}"
            )
        target = self._staging / path
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as handle:
            handle.write(chunk.data)
        self._written[path] += len(chunk.data)
        self._draw()

    def _draw(self) -> None:
        if self._bar is not None:
            done = sum(self._written.values())
            self._bar.draw(done, f"{done / MIB:.1f}/{self._bar.total / MIB:.1f} MiB")

    def finish(self) -> ExportedWeights:
        weights = self._weights
        if weights is None:
            raise ExportProtocolError("the stream ended before the export's description")
        for file in weights.files:
            path = _safe_relative(file.path).as_posix()
            if self._written[path] != file.size_bytes:
                raise ExportProtocolError(
                    f"{path!r}: received {self._written[path]} of {file.size_bytes} bytes"
                )
            # A file of size 0 has no chunk: create it.
            (self._staging / path).touch()
        self._close_bar()
        if self.directory.exists():
            self.directory.rmdir()  # empty, as check_export_target made sure
        os.replace(self._staging, self.directory)
        return ExportedWeights(
            model=weights.model,
            policy_version=weights.policy_version,
            base_model=weights.base_model,
            directory=self.directory,
            files=tuple(f.path for f in weights.files),
        )

    def discard(self) -> None:
        self._close_bar()
        shutil.rmtree(self._staging, ignore_errors=True)

    def _close_bar(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
