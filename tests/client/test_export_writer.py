"""The SDK's side of ExportWeights: a stream becomes a directory only when whole, and a stream that
breaks the contract (order, paths, offsets, sizes) is refused without leaving files behind."""

from __future__ import annotations

from pathlib import Path

import pytest

import tinkerrpc
from tinkerrpc import _calls as calls
from tinkerrpc._export import WeightsWriter
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb

pytestmark = pytest.mark.unit

CONFIG = b'{"r": 8}'
WEIGHTS = bytes(range(256)) * 5


def header(*files: tuple[str, int]) -> service_pb.ExportWeightsResponse:
    return service_pb.ExportWeightsResponse(
        weights=pb.ExportedWeights(
            model="m",
            policy_version=3,
            base_model="base",
            files=[pb.ExportedFile(path=path, size_bytes=size) for path, size in files],
        )
    )


def chunk(path: str, offset: int, data: bytes) -> service_pb.ExportWeightsResponse:
    return service_pb.ExportWeightsResponse(chunk=pb.FileChunk(path=path, offset=offset, data=data))


def staging_dirs(parent: Path) -> list[Path]:
    return list(parent.glob(".*.partial-*"))


def test_a_whole_stream_becomes_the_directory(tmp_path: Path) -> None:
    target = tmp_path / "out" / "adapter"
    writer = WeightsWriter(target)
    stream = [
        header(
            ("adapter_config.json", len(CONFIG)), ("adapter_model.safetensors", len(WEIGHTS)), ("empty", 0)
        ),
        chunk("adapter_config.json", 0, CONFIG),
        chunk("adapter_model.safetensors", 0, WEIGHTS[:1000]),
        chunk("adapter_model.safetensors", 1000, WEIGHTS[1000:]),
    ]
    for response in stream:
        writer.add(response)
        assert not target.exists(), "nothing appears before the stream is complete"
    exported = writer.finish()
    assert exported == tinkerrpc.ExportedWeights(
        "m", 3, "base", target, ("adapter_config.json", "adapter_model.safetensors", "empty")
    )
    assert (target / "adapter_config.json").read_bytes() == CONFIG
    assert (target / "adapter_model.safetensors").read_bytes() == WEIGHTS
    assert (target / "empty").read_bytes() == b""
    assert staging_dirs(target.parent) == []


@pytest.mark.parametrize(
    ("stream", "message"),
    [
        ([chunk("a", 0, b"x")], "before the export's description"),
        ([header(("a", 1)), header(("a", 1))], "twice"),
        ([header(("../escape", 1))], "unsafe file path"),
        ([header(("/etc/passwd", 1))], "unsafe file path"),
        ([header(("a", 2)), chunk("b", 0, b"x")], "does not list"),
        ([header(("a", 2)), chunk("a", 1, b"x")], "offset 1, expected 0"),
    ],
)
def test_contract_breaks_are_refused(
    tmp_path: Path, stream: list[service_pb.ExportWeightsResponse], message: str
) -> None:
    writer = WeightsWriter(tmp_path / "adapter")
    with pytest.raises(tinkerrpc.ExportProtocolError, match=message):
        for response in stream:
            writer.add(response)
    writer.discard()
    assert staging_dirs(tmp_path) == [] and not (tmp_path / "adapter").exists()


def test_a_short_file_or_a_missing_description_fails_at_the_end(tmp_path: Path) -> None:
    writer = WeightsWriter(tmp_path / "adapter")
    writer.add(header(("a", 4)))
    writer.add(chunk("a", 0, b"abc"))
    with pytest.raises(tinkerrpc.ExportProtocolError, match="received 3 of 4 bytes"):
        writer.finish()
    writer.discard()
    with pytest.raises(tinkerrpc.ExportProtocolError, match="ended before"):
        WeightsWriter(tmp_path / "other").finish()
    assert not (tmp_path / "adapter").exists()


def test_export_refuses_a_non_empty_target_before_sending(tmp_path: Path) -> None:
    (tmp_path / "taken").mkdir()
    (tmp_path / "taken" / "file").write_text("mine")
    with pytest.raises(FileExistsError):
        calls.export_weights("m", tmp_path / "taken")
    (tmp_path / "empty").mkdir()
    call = calls.export_weights("m", tmp_path / "empty", expected_policy_version=2)
    assert call.rpc == "ExportWeights" and call.request.expected_policy_version == 2
    with pytest.raises(ValueError, match="expected_policy_version"):
        calls.export_weights("m", tmp_path / "new", expected_policy_version=-1)


def test_progress_shows_the_bytes_received(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    writer = WeightsWriter(tmp_path / "adapter", progress=True)
    writer.add(header(("adapter_model.safetensors", 3 << 20)))
    writer.add(chunk("adapter_model.safetensors", 0, bytes(1 << 20)))
    writer.add(chunk("adapter_model.safetensors", 1 << 20, bytes(2 << 20)))
    writer.finish()
    drawn = capsys.readouterr().err
    assert "export m@3: 0.0/3.0 MiB" in drawn and "1.0/3.0 MiB" in drawn
    assert "3.0/3.0 MiB [########################]" in drawn and drawn.endswith("\n")
