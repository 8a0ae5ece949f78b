"""What a killed engine leaves in its data dir is removed when the next one starts: the staging directory
of a save cut short, and run directories whose checkpoints were all deleted. Published checkpoints and
runs that still hold one stay."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinkerrpc_server.engine.storage import CheckpointRecord, RunRecord, Storage, now_iso

pytestmark = pytest.mark.unit


def test_staging_dirs_and_empty_run_dirs_go_at_start(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    created = now_iso()
    storage.put_run(RunRecord("live", "base", 1, None, True, True, True, created, created))
    kept = storage.checkpoint_dir("live", "training", "step_000003")
    kept.mkdir(parents=True)
    (kept / "adapter_model.safetensors").write_bytes(b"weights")
    storage.add_checkpoint(CheckpointRecord("live", "training", "step_000003", created, size_bytes=7))
    staging = kept.parent / ".step_000004.tmp-k1ll3d"
    staging.mkdir()
    (staging / "adapter_model.safetensors").write_bytes(b"half")
    empty_kind = storage.checkpoint_dir("live", "sampler", "v000001").parent
    empty_kind.mkdir(parents=True)
    emptied_run = tmp_path / "runs" / "before-restart" / "sampler_weights"
    emptied_run.mkdir(parents=True)
    storage.close()

    Storage(tmp_path).close()
    assert not staging.exists()
    assert not empty_kind.exists()
    assert not emptied_run.parent.exists()
    assert (kept / "adapter_model.safetensors").read_bytes() == b"weights"
    assert sorted(p.name for p in (tmp_path / "runs").iterdir()) == ["live"]
