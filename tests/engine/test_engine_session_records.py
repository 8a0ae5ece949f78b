"""A long run that opens sessions (every SDK ServiceClient opens one) does not grow the engine's session
records for ever: past MAX_ENGINE_SESSION_RECORDS the oldest ended sessions are forgotten, while a running
session, one with a live training client and one whose run holds a checkpoint stay listed. Driven
through the real tinker SDK against a real engine process; the bulk of sessions is opened and finished
with the requests the SDK sends for that."""

from __future__ import annotations

import time

import httpx
import pytest
import tinker
from engine_proc import TINY

from tinkerrpc.contract.limits import MAX_ENGINE_PAGE_SIZE, MAX_ENGINE_SESSION_RECORDS
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

FINISHED = {"reason": {"type": "success"}, "detail": None}


def session_of(model_id: str) -> str:
    return model_id.split(":train:")[0]


def listed(rest: tinker.RestClient) -> list[str]:
    """Every recorded session, newest first, page by page as the SDK lists them."""
    found: list[str] = []
    while page := rest.list_sessions(limit=MAX_ENGINE_PAGE_SIZE, offset=len(found)).result().sessions:
        found += page
    return found


def open_and_finish(http: httpx.Client) -> str:
    """A session opened and finished with the SDK's own requests (ServiceClient, then close)."""
    body = {"tags": [], "user_metadata": {}, "sdk_version": tinker.__version__}
    session_id: str = http.post("create_session", json=body).raise_for_status().json()["session_id"]
    http.post(f"sessions/{session_id}/finish", json=FINISHED).raise_for_status()
    return session_id


def test_past_the_cap_the_oldest_ended_sessions_go_and_those_still_needed_stay(engine: LocalEngine) -> None:
    rest = engine.rest_client()
    with tinker.ServiceClient(base_url=engine.base_url, api_key=engine.api_key) as plain:
        plain_id = plain.holder.get_session_id()  # ended, made nothing: the first to go
    with tinker.ServiceClient(base_url=engine.base_url, api_key=engine.api_key) as saver:
        saving = saver.create_lora_training_client(TINY, rank=4, seed=1).result()
        saved = saving.save_state("kept").result().path  # ended, but its run holds a checkpoint
    live_service = engine.service_client()
    live = live_service.create_lora_training_client(TINY, rank=4, seed=2).result()
    saver_id, live_id = session_of(saving.model_id), session_of(live.model_id)
    assert listed(rest) == [live_id, saver_id, plain_id]

    url = f"{engine.base_url}/api/v1/"
    with httpx.Client(base_url=url, headers=engine.auth_headers, timeout=60) as http:
        started = time.monotonic()
        bulk = [open_and_finish(http) for _ in range(MAX_ENGINE_SESSION_RECORDS)]
        seconds = time.monotonic() - started
        # 3 + cap records: 3 forgotten, oldest ended first: plain_id and the 2 oldest of the bulk; the
        # checkpoint's session is older than those two but stays, as does the running one.
        assert listed(rest) == [*reversed(bulk[2:]), live_id, saver_id], f"{seconds:.1f} s for the bulk"
        with pytest.raises(tinker.NotFoundError):
            rest.get_session(plain_id).result()
        assert [c.tinker_path for c in rest.list_checkpoints(saving.model_id).result().checkpoints] == [saved]
        assert rest.get_session(saver_id).result().training_run_ids == [saving.model_id]

        # Once the live session ends (its training client unloaded after its queued work), it may go too.
        live_service.close("success").result()
        for _ in range(100):
            opened = open_and_finish(http)
            if live_id not in listed(rest):
                break
            time.sleep(0.1)
        everything = listed(rest)
        assert live_id not in everything and everything[0] == opened and saver_id in everything
        assert len(everything) == MAX_ENGINE_SESSION_RECORDS
