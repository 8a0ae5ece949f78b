"""A service that rebuilds its training client after every failed step does not grow the engine's
training-run records for ever: past MAX_ENGINE_RUN_RECORDS the least recently used idle runs (no
checkpoint left, no training client in memory) are forgotten and answer 404, while a run with a
checkpoint and a live one stay, across a restart. Driven through the real tinker SDK against a real engine
process; the bulk of training clients is made and unloaded with the requests the SDK and the service
send for that."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import tinker
from engine_proc import TINY, start_engine

from tinkerrpc.contract.limits import MAX_ENGINE_PAGE_SIZE, MAX_ENGINE_RUN_RECORDS

pytestmark = pytest.mark.process


def listed(rest: tinker.RestClient) -> list[str]:
    """Every training run, newest first, page by page as the SDK lists them."""
    found: list[str] = []
    while (
        page := rest.list_training_runs(limit=MAX_ENGINE_PAGE_SIZE, offset=len(found)).result().training_runs
    ):
        found += [run.training_run_id for run in page]
    return found


def settle(http: httpx.Client, request_id: str) -> dict[str, object]:
    """The answer of an engine future, polled as the SDK polls it."""
    while True:
        answer: dict[str, object] = (
            http.post("retrieve_future", json={"request_id": request_id}).raise_for_status().json()
        )
        if answer.get("type") != "try_again":
            return answer


def unload(http: httpx.Client, model_id: str) -> None:
    """Drop a training client, as the service does when it rebuilds one."""
    request_id = (
        http.post("unload_model", json={"model_id": model_id}).raise_for_status().json()["request_id"]
    )
    assert settle(http, request_id) == {"model_id": model_id, "type": "unload_model"}


def rebuild(http: httpx.Client, session_id: str, model_seq_id: int) -> str:
    """A training client made (as the SDK's create_lora_training_client) and dropped again."""
    body = {
        "session_id": session_id,
        "model_seq_id": model_seq_id,
        "base_model": TINY,
        "lora_config": {"rank": 1},
    }
    request_id = http.post("create_model", json=body).raise_for_status().json()["request_id"]
    model_id = f"{session_id}:train:{model_seq_id}"
    assert settle(http, request_id) == {"model_id": model_id, "type": "create_model"}
    unload(http, model_id)
    return model_id


def test_past_the_cap_idle_runs_go_and_runs_with_a_checkpoint_or_a_client_stay(
    tmp_path: Path, model_dir: Path
) -> None:
    engine = start_engine(tmp_path / "data", model_dir, tmp_path / "engine.log")
    try:
        rest = engine.rest_client()
        url = f"{engine.base_url}/api/v1/"
        service = engine.service_client()
        with service, httpx.Client(base_url=url, headers=engine.auth_headers, timeout=60) as http:
            saving = service.create_lora_training_client(TINY, rank=1, seed=1).result()
            saved = saving.save_state("kept").result().path
            unload(http, saving.model_id)  # no client, but a checkpoint: stays
            emptied = service.create_lora_training_client(TINY, rank=1, seed=2).result()
            gone = emptied.save_weights_for_sampler("gone").result().path
            rest.delete_checkpoint_from_tinker_path(gone).result()
            unload(http, emptied.model_id)  # no client and no checkpoint left: idle, the oldest
            live = service.create_lora_training_client(TINY, rank=1, seed=3).result()  # live, no checkpoint
            assert rest.get_training_run(emptied.model_id).result().last_sampler_checkpoint is None
            assert listed(rest) == [live.model_id, emptied.model_id, saving.model_id]

            session = {"tags": [], "user_metadata": {}, "sdk_version": tinker.__version__}
            rebuilding = http.post("create_session", json=session).raise_for_status().json()["session_id"]
            bulk = []
            for model_seq_id in range(MAX_ENGINE_RUN_RECORDS):
                bulk.append(rebuild(http, rebuilding, model_seq_id))
                if model_seq_id % 50 == 0:  # the SDK's heartbeats, which keep the session open
                    http.post("session_heartbeat", json={"session_id": rebuilding}).raise_for_status()

            # 3 + cap runs were made: the 3 least recently used idle ones went, the emptied run first.
            everything = [*reversed(bulk[2:]), live.model_id, saving.model_id]
            assert listed(rest) == everything
            assert rest.list_training_runs(limit=1).result().cursor.total_count == MAX_ENGINE_RUN_RECORDS
            for forgotten in (emptied.model_id, *bulk[:2]):
                with pytest.raises(tinker.NotFoundError):
                    rest.get_training_run(forgotten).result()
            with pytest.raises(tinker.NotFoundError):
                rest.list_checkpoints(emptied.model_id).result()
            # What needs the kept run answers: its checkpoint's listing, the run by the checkpoint's path
            # (the cookbook's get_training_run_by_tinker_path), a client loaded from it.
            last = rest.get_training_run(saving.model_id).result().last_checkpoint
            assert last is not None and last.tinker_path == saved
            assert rest.get_training_run_by_tinker_path(saved).result().training_run_id == saving.model_id
            assert [c.tinker_path for c in rest.list_checkpoints(saving.model_id).result().checkpoints] == [
                saved
            ]
            assert live.save_state("later").result().path.startswith(f"tinker://{live.model_id}/")
            restored = service.create_training_client_from_state(saved).result()
            # One more run: the least recently used idle one goes.
            everything = [restored.model_id, *everything]
            everything.remove(bulk[2])
            assert listed(rest) == everything
    finally:
        assert engine.stop() == 0, engine.log()[-3000:]

    # A new engine has no training client in memory: every run is idle, but within the cap and the idle
    # limit; the forgotten ones stay forgotten (the journal), the rest stay listed.
    engine = start_engine(tmp_path / "data", model_dir, tmp_path / "second.log")
    try:
        rest = engine.rest_client()
        assert listed(rest) == everything
        for forgotten in (emptied.model_id, bulk[2]):
            with pytest.raises(tinker.NotFoundError):
                rest.get_training_run(forgotten).result()
    finally:
        assert engine.stop() == 0, engine.log()[-3000:]
