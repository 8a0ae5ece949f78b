"""The engine keeps only what is in use: a finished session's training clients are freed (adapter and
optimizer state; tests/service/test_retention.py covers those the service drops), unnamed sampler
snapshots stay bounded (test_engine_snapshots.py: how long each lives), and a checkpoint saved with ttl_seconds is gone once it passes."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from tinkerrpc_server.engine.snapshots import UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
from tinkerrpc_server.engine.storage import CheckpointRecord, RunRecord, Storage, now_iso, read_index
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process


def _live_models(engine: LocalEngine) -> int:
    stats = httpx.get(f"{engine.base_url}/api/v1/debug/stats", headers=engine.auth_headers, timeout=30)
    stats.raise_for_status()
    return int(stats.json()["live_models"])


def test_a_finished_session_frees_its_training_clients(engine: LocalEngine) -> None:
    baseline = _live_models(engine)
    service = engine.service_client()
    for _ in range(3):
        service.create_lora_training_client(base_model="tinkerrpc/tiny-chat", rank=2).result()
    assert _live_models(engine) == baseline + 3
    service.close("success").result(timeout=30)
    deadline = time.monotonic() + 30
    while _live_models(engine) != baseline and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _live_models(engine) == baseline


def test_a_finished_session_answers_410_and_makes_nothing_more(engine: LocalEngine) -> None:
    """The SDK stops heartbeating on 410; a finished session cannot load what nothing would free."""

    def post(path: str, body: dict[str, object]) -> httpx.Response:
        return httpx.post(
            f"{engine.base_url}/api/v1/{path}", json=body, headers=engine.auth_headers, timeout=30
        )

    session_id = post("create_session", {}).json()["session_id"]
    heartbeat = {"session_id": session_id, "type": "session_heartbeat"}
    assert post("session_heartbeat", heartbeat).status_code == 200
    assert post(f"sessions/{session_id}/finish", {}).status_code == 200
    gone = post("session_heartbeat", heartbeat)
    assert gone.status_code == 410 and "finished" in gone.json()["detail"]
    before = _live_models(engine)
    create = {"session_id": session_id, "model_seq_id": 0, "base_model": "tinkerrpc/tiny-chat"}
    refused = post("create_model", create)
    assert refused.status_code == 400 and "finished" in refused.json()["detail"]
    assert _live_models(engine) == before


@pytest.mark.parametrize("named", [False, True])
def test_unnamed_sampler_snapshots_are_ephemeral(engine: LocalEngine, named: bool) -> None:
    with engine.service_client() as service:
        client = service.create_lora_training_client(base_model="tinkerrpc/tiny-chat", rank=2).result()
        rest = engine.rest_client()
        for step in range(3):
            if named:
                client.save_weights_for_sampler(f"kept-{step}").result()
            else:
                client.save_weights_and_get_sampling_client().result()
        listed = rest.list_checkpoints(client.model_id).result().checkpoints
        samplers = [c for c in listed if c.checkpoint_type == "sampler"]
        # Named ones stay; unnamed ones stay while their sampling clients' session lives, within the cap.
        assert len(samplers) == (3 if named else min(3, UNNAMED_SNAPSHOTS_KEPT_PER_MODEL))


def test_ttl_seconds_expire_checkpoints(engine: LocalEngine) -> None:
    with engine.service_client() as service:
        client = service.create_lora_training_client(base_model="tinkerrpc/tiny-chat", rank=2).result()
        short = client.save_state("short-lived", ttl_seconds=1).result().path
        kept = client.save_state("kept").result().path
        listed = engine.rest_client().list_checkpoints(client.model_id).result().checkpoints
        assert {short, kept} <= {c.tinker_path for c in listed}
        time.sleep(1.5)
        listed = engine.rest_client().list_checkpoints(client.model_id).result().checkpoints
        assert kept in {c.tinker_path for c in listed} and short not in {c.tinker_path for c in listed}


def test_the_index_journal_stays_proportional_to_what_it_holds(tmp_path: Path) -> None:
    storage = Storage(tmp_path)
    storage.put_run(RunRecord("run", "tinkerrpc/tiny-chat", 1, None, True, True, True, now_iso(), now_iso()))
    for step in range(1500):
        record = CheckpointRecord("run", "sampler", f"v{step:06d}", now_iso(), 1)
        storage.add_checkpoint(record)
        if step >= 16:
            storage.delete_checkpoint("run", f"sampler_weights/v{step - 16:06d}")
    journal = tmp_path / "engine_index.jsonl"
    assert len(journal.read_text().splitlines()) <= 300, "compacted as it grows, not only at start"
    storage.close()
    runs, checkpoints = read_index(tmp_path)
    assert [r.model_id for r in runs] == ["run"]
    assert sorted(c.name for c in checkpoints) == [f"v{step:06d}" for step in range(1484, 1500)]
    # A new engine on the data dir sees the same, from one line per record.
    Storage(tmp_path).close()
    assert len(journal.read_text().splitlines()) == 17
