"""Tinker 0.38's REST calls through the unmodified SDK against a real engine (issue 41): copy_weights,
publish/unpublish, sessions (list, get, search, project, trace export), whoami through the SDK's JWT
exchange, the admin calls (audit log, billing, checkpoint storage), age-encrypted external weights, and
create-via-load. Each answers with Tinker's semantics where they have a local meaning
(docs/tinker_parity.md says which the engine chose), and refuses bad input, changing nothing."""

from __future__ import annotations

import os
from datetime import date, datetime, timedelta, timezone
from pathlib import Path

import httpx
import numpy as np
import pyrage  # type: ignore[import-untyped]
import pytest
import tinker
from engine_proc import TINY, seq_gaps
from tinker import types

from tinkerrpc.contract.limits import MAX_ENGINE_PAGE_SIZE
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

ADAM = types.AdamParams(learning_rate=1e-2)
# A refusal the SDK does not retry arrives well within this; one it retries takes 5 minutes.
REFUSAL_SECONDS = 30
PROBE = types.Datum(
    model_input=types.ModelInput.from_ints([31, 32, 33, 34, 35, 36]),
    loss_fn_inputs={
        "target_tokens": np.asarray([32, 33, 34, 35, 36, 37], dtype=np.int64),
        "weights": np.ones(6, dtype=np.float32),
    },
)


def probe(client: tinker.TrainingClient) -> np.ndarray:
    out = client.forward([PROBE], "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def trained(service: tinker.ServiceClient, seed: int) -> tinker.TrainingClient:
    client = service.create_lora_training_client(TINY, rank=4, seed=seed).result()
    client.forward_backward([PROBE], "cross_entropy").result()
    client.optim_step(ADAM).result()
    return client


def post(engine: LocalEngine, path: str, body: dict[str, object], **headers: str) -> httpx.Response:
    return httpx.post(
        f"{engine.base_url}/api/v1/{path}", json=body, headers={**engine.auth_headers, **headers}, timeout=60
    )


def checkpoint_dir(engine: LocalEngine, tinker_path: str) -> Path:
    model_id, segment, name = tinker_path.removeprefix("tinker://").split("/")
    return engine.data_dir / "runs" / model_id / segment / name


def session_of(model_id: str) -> str:
    return model_id.split(":train:")[0]


@pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")
def test_copy_weights_makes_a_run_sharing_the_sources_bytes(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    client = trained(service, seed=1)
    expected = probe(client)
    state = client.save_state("s1").result().path
    runs_before = rest.list_training_runs(limit=MAX_ENGINE_PAGE_SIZE).result().cursor.total_count

    copied = rest.copy_weights(state, "proj-archive", ttl_seconds=7200).result()
    run_id, segment, name = copied.removeprefix("tinker://").split("/")
    assert (segment, name) == ("weights", "s1") and run_id != client.model_id
    run = rest.get_training_run(run_id).result()
    assert (run.base_model, run.lora_rank) == (TINY, 4)
    [listed] = rest.list_checkpoints(run_id).result().checkpoints
    assert listed.tinker_path == copied and listed.expires_at is not None
    remaining = (listed.expires_at - datetime.now(timezone.utc)).total_seconds()
    assert 7000 < remaining <= 7200
    # The copy's files are the source's (hard links): no byte is duplicated.
    source_files = sorted(p for p in checkpoint_dir(engine, state).rglob("*") if p.is_file())
    copy_files = sorted(p for p in checkpoint_dir(engine, copied).rglob("*") if p.is_file())
    assert [p.name for p in source_files] == [p.name for p in copy_files] and source_files
    assert all(os.path.samefile(a, b) for a, b in zip(source_files, copy_files, strict=True))
    # It belongs to a new session in the project, and no client trains it.
    view = rest.get_session(session_of(run_id)).result()
    assert view.training_run_ids == [run_id]
    found = rest.search_sessions(types.SessionSearchRequest(project_ids=["proj-archive"])).result()
    assert [s.session_id for s in found.sessions] == [session_of(run_id)]
    # Deleting the source leaves the copy whole: it loads, with the same weights.
    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not checkpoint_dir(engine, state).exists()
    np.testing.assert_array_equal(probe(service.create_training_client_from_state(copied).result()), expected)

    # ServiceClient.copy_weights copies into its own project, keeping the kind.
    sampler = client.save_weights_for_sampler("w1").result().path
    with tinker.ServiceClient(base_url=engine.base_url, api_key=engine.api_key, project_id="proj-b") as other:
        sampler_copy = other.copy_weights(sampler).result()
    assert sampler_copy.endswith("/sampler_weights/w1") and not sampler_copy.startswith(
        f"tinker://{client.model_id}"
    )
    # The two copies, and the client loaded from the first.
    runs_after = rest.list_training_runs(limit=MAX_ENGINE_PAGE_SIZE).result().cursor.total_count
    assert runs_after == runs_before + 3


def test_copy_weights_refuses_bad_requests_and_answers_a_retry_once(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    client = trained(service, seed=2)
    sampler = client.save_weights_for_sampler("w2").result().path
    runs = rest.list_training_runs(limit=MAX_ENGINE_PAGE_SIZE).result().cursor.total_count

    with pytest.raises(tinker.NotFoundError, match="no checkpoint"):
        rest.copy_weights(f"{sampler}-missing", "proj-a").result()
    with pytest.raises(tinker.BadRequestError, match="destination_project_id"):
        rest.copy_weights(sampler, "../up").result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.copy_weights(sampler, "proj-a", ttl_seconds=0).result()
    with pytest.raises(tinker.BadRequestError, match="ttl_seconds"):
        rest.copy_weights(sampler, "proj-a", ttl_seconds=10**12).result()
    with pytest.raises(tinker.BadRequestError, match="weights_access_token"):
        rest.copy_weights(sampler, "proj-a", weights_access_token="tok").result()
    both = {"source_path": sampler, "destination_project_id": "p", "session_id": "s1", "model_seq_id": 3}
    assert post(engine, "copy_weights", both).status_code == 400
    assert rest.list_training_runs(limit=MAX_ENGINE_PAGE_SIZE).result().cursor.total_count == runs

    # A retried copy (same X-Idempotency-Key) is the first one.
    body = {"source_path": sampler, "destination_project_id": "proj-c"}
    first = post(engine, "copy_weights", body, **{"X-Idempotency-Key": "k-1"})
    again = post(engine, "copy_weights", body, **{"X-Idempotency-Key": "k-1"})
    assert first.status_code == again.status_code == 200 and first.json() == again.json()
    assert post(engine, "copy_weights", body, **{"X-Idempotency-Key": "k" * 300}).status_code == 400
    # Into a session's model slot, once: the slot then exists.
    session_id = session_of(client.model_id)
    slot = {"source_path": sampler, "session_id": session_id, "model_seq_id": 900}
    assert post(engine, "copy_weights", slot).json() == {
        "tinker_path": f"tinker://{session_id}:train:900/sampler_weights/w2"
    }
    conflict = post(engine, "copy_weights", slot)
    assert conflict.status_code == 400 and "already exists" in conflict.json()["detail"]
    unknown = post(engine, "copy_weights", {**slot, "session_id": "s-never"})
    assert unknown.status_code == 404 and "unknown session" in unknown.json()["detail"]
    negative = post(engine, "copy_weights", {**slot, "model_seq_id": -1})
    assert negative.status_code == 400 and "model_seq_id" in negative.json()["detail"]


def test_publish_and_unpublish_flip_public_and_refuse_repeats(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    client = trained(service, seed=3)
    path = client.save_state("pub").result().path
    # A checkpoint named "publish" is an ordinary one: deleting it is no unpublish.
    odd = client.save_state("publish").result().path

    def public() -> dict[str, bool]:
        return {c.tinker_path: c.public for c in rest.list_checkpoints(client.model_id).result().checkpoints}

    assert public() == {path: False, odd: False}
    rest.publish_checkpoint_from_tinker_path(path).result()
    assert public() == {path: True, odd: False}
    assert any(c.public for c in rest.list_user_checkpoints(limit=MAX_ENGINE_PAGE_SIZE).result().checkpoints)
    # A repeat fails at once through the SDK (Tinker's 409 would be retried for 5 minutes), changing nothing.
    with pytest.raises(tinker.BadRequestError, match="already public"):
        rest.publish_checkpoint_from_tinker_path(path).result(timeout=REFUSAL_SECONDS)
    assert public() == {path: True, odd: False}
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    assert public() == {path: False, odd: False}
    with pytest.raises(tinker.BadRequestError, match="already private"):
        rest.unpublish_checkpoint_from_tinker_path(path).result(timeout=REFUSAL_SECONDS)
    assert public() == {path: False, odd: False}
    with pytest.raises(tinker.NotFoundError):
        rest.publish_checkpoint_from_tinker_path(f"tinker://{client.model_id}/weights/none").result()
    rest.delete_checkpoint_from_tinker_path(odd).result()
    assert public() == {path: False}


@pytest.mark.filterwarnings("ignore:RestClient.search_sessions is experimental")
def test_sessions_are_listed_searched_moved_and_traced_from_the_engines_records(
    engine: LocalEngine,
) -> None:
    rest = engine.rest_client()
    started = datetime.now(timezone.utc)
    own = tinker.ServiceClient(
        user_metadata={"experiment": "e7"},
        project_id="proj-x",
        display_name="Nightly Run 7",
        base_url=engine.base_url,
        api_key=engine.api_key,
    )
    client = own.create_lora_training_client(TINY, rank=4, seed=4).result()
    client.forward_backward([PROBE], "cross_entropy").result()
    session_id = session_of(client.model_id)

    assert rest.list_sessions(limit=1).result().sessions == [session_id]  # newest first
    assert session_id in rest.list_sessions(limit=MAX_ENGINE_PAGE_SIZE).result().sessions
    view = rest.get_session(session_id).result()
    assert view.training_run_ids == [client.model_id]
    assert (view.user_metadata, view.display_name) == ({"experiment": "e7"}, "Nightly Run 7")

    [found] = rest.search_sessions(types.SessionSearchRequest(display_name="nightly 7")).result().sessions
    assert (found.session_id, found.project_id, found.status) == (
        session_id,
        "proj-x",
        types.SessionActive(),
    )
    assert found.user_metadata == {"experiment": "e7"} and found.created_at >= started - timedelta(seconds=5)
    me = rest.whoami().result().user_urn
    by_owner = types.SessionSearchRequest(session_id=session_id, owner=types.UserSearchOwner(owner_urns=[me]))
    assert [s.session_id for s in rest.search_sessions(by_owner).result().sessions] == [session_id]
    finished = types.SessionSearchRequest(
        session_id=session_id, statuses=[types.ClientFinishedSessionStatusQuery(reasons=["errored"])]
    )
    assert rest.search_sessions(finished).result().sessions == []

    rest.assign_session_project(session_id, "proj-y").result()
    moved = rest.search_sessions(types.SessionSearchRequest(project_ids=["proj-y"])).result()
    assert [s.session_id for s in moved.sessions] == [session_id]
    in_project = rest.list_training_runs(project_id="proj-y").result().training_runs
    assert [r.training_run_id for r in in_project] == [client.model_id]

    trace_url = rest.export_session_trace(session_id).result()
    own.close("errored", "boom").result()
    assert [s.session_id for s in rest.search_sessions(finished).result().sessions] == [session_id]
    [closed] = rest.search_sessions(types.SessionSearchRequest(session_id=session_id)).result().sessions
    assert closed.status == types.ClientSessionFinished(
        reason=types.ClientSessionFinishErrored(), detail="boom"
    )

    # Pages: one session per page, each page's cursor leads to the next, newest first.
    pages, request = [], types.SessionSearchRequest(limit=1, owner=types.AccessibleSearchOwner())
    while len(pages) < 3:
        page = rest.search_sessions(request).result()
        pages += [s.session_id for s in page.sessions]
        if page.next_cursor is None:
            break
        request = request.model_copy(update={"cursor": page.next_cursor})
    listed = rest.list_sessions(limit=3).result().sessions
    assert pages == listed[: len(pages)] and len(set(pages)) == len(pages)

    # The trace downloads without the key (its URL is signed) and holds the session's requests.
    trace = httpx.get(trace_url, timeout=30)
    assert trace.status_code == 200
    events = [e for e in trace.json()["traceEvents"] if e["ph"] == "X"]
    names = {e["name"] for e in events}
    assert {"training_run_create", "training_run_forward_backward"} <= names
    assert all(e["args"].get("model_id", client.model_id).startswith(session_id) for e in events)
    assert httpx.get(trace_url.replace("signature=", "signature=0"), timeout=30).status_code == 403

    # Bad input is refused and changes nothing.
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_sessions(limit=0).result()
    with pytest.raises(tinker.BadRequestError, match="limit"):
        rest.list_sessions(limit=MAX_ENGINE_PAGE_SIZE + 1).result()
    with pytest.raises(tinker.NotFoundError):
        rest.get_session("s-never").result()
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        rest.assign_session_project(session_id, "../x").result()
    with pytest.raises(tinker.BadRequestError, match="display_name"):
        rest.search_sessions(types.SessionSearchRequest(display_name="n" * 5000)).result()
    with pytest.raises(tinker.BadRequestError, match="project_ids"):
        rest.search_sessions(types.SessionSearchRequest(project_ids=[f"p{i}" for i in range(65)])).result()
    assert (
        post(
            engine, "create_session", {"tags": ["t"] * 65, "user_metadata": {}, "sdk_version": "x"}
        ).status_code
        == 400
    )
    long_name = {"tags": [], "user_metadata": {}, "sdk_version": "x", "display_name": "n" * 5000}
    assert post(engine, "create_session", long_name).status_code == 400
    assert session_id == rest.list_sessions(limit=1).result().sessions[0]


def test_whoami_reads_a_token_that_only_the_key_gets(engine: LocalEngine) -> None:
    who = engine.rest_client().whoami().result()
    assert (who.user_urn, who.org_urn, who.email) == ("tml:user:local", "tml:organization:local", None)

    token = post(engine, "auth/token", {}).json()["jwt"]
    runs = f"{engine.base_url}/api/v1/training_runs"
    assert httpx.get(runs, headers={"X-API-Key": token}, timeout=30).status_code == 200
    forged = token[:-4] + ("AAAA" if not token.endswith("AAAA") else "BBBB")
    refused = httpx.get(runs, headers={"X-API-Key": forged}, timeout=30)
    assert refused.status_code == 401 and 'error="invalid_token"' in refused.headers["www-authenticate"]
    # A token cannot renew itself, and nothing without the key gets one.
    assert httpx.post(f"{engine.base_url}/api/v1/auth/token", headers={"X-API-Key": token}).status_code == 401
    assert httpx.post(f"{engine.base_url}/api/v1/auth/token", json={}).status_code == 401
    with pytest.raises(tinker.AuthenticationError):
        tinker.RestClient(base_url=engine.base_url, api_key="tml-" + "x" * 40).whoami().result()


def test_admin_calls_answer_from_the_engines_own_records(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    admin = tinker.AdminClient(base_url=engine.base_url, api_key=engine.api_key)
    rest = engine.rest_client()
    client = trained(service, seed=5)
    path = client.save_state("audited").result().path
    rest.publish_checkpoint_from_tinker_path(path).result()

    checkpoints = admin.get_audit_log(event_type="checkpoints").result().entries
    assert checkpoints and all(e.event.startswith("checkpoint_") for e in checkpoints)
    published = [e for e in checkpoints if e.event == "checkpoint_publish" and e.tinker_path == path]
    assert len(published) == 1 and published[0].event_details["status"] == 200
    saves = [e for e in checkpoints if e.event == "checkpoint_save" and e.model_id == client.model_id]
    assert saves and all("tml-" not in str(e.event_details) for e in checkpoints)
    assert [e.timestamp for e in checkpoints] == sorted(e.timestamp for e in checkpoints)
    everything = admin.get_audit_log().result().entries
    assert {"session_create", "training_run_create"} <= {e.event for e in everything}
    assert admin.get_audit_log(event_type="teams").result().entries == []
    assert admin.get_audit_log(day=date.today() - timedelta(days=2)).result().entries == []

    hour = datetime.now(timezone.utc).replace(minute=0, second=0, microsecond=0)
    usage = admin.get_billing_usage(hour - timedelta(hours=2), hour).result()
    assert (usage.data, usage.sessions, usage.cost_data_through) == ([], {}, None)
    with pytest.raises(tinker.BadRequestError, match="hour"):
        admin.get_billing_usage(hour - timedelta(minutes=30), hour).result()
    with pytest.raises(tinker.BadRequestError, match="14 days"):
        admin.get_billing_usage(hour - timedelta(days=15), hour).result()
    with pytest.raises(tinker.BadRequestError, match="future"):
        admin.get_billing_usage(hour + timedelta(hours=2), hour + timedelta(hours=3)).result()

    storage = admin.get_current_checkpoint_storage_usage().result()
    live = rest.list_user_checkpoints(limit=MAX_ENGINE_PAGE_SIZE).result().checkpoints
    stored = {
        (os.stat(f).st_dev, os.stat(f).st_ino): os.stat(f).st_size
        for c in live
        for f in checkpoint_dir(engine, c.tinker_path).rglob("*")
        if f.is_file()
    }
    assert sum(item.checkpoint_count for item in storage.data) == len(live)
    assert sum(item.size_bytes for item in storage.data) == sum(stored.values())
    assert all(item.estimated_monthly_cost_usd == 0.0 for item in storage.data)
    assert storage.effective_rate_usd_per_gigabyte_month == 0.0
    with pytest.raises(tinker.BadRequestError, match="project_id"):
        admin.get_current_checkpoint_storage_usage(project_id="../x").result()


def test_age_encrypted_external_weights_decrypt_to_the_plain_export(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    client = trained(service, seed=6)
    identity = pyrage.x25519.Identity.generate()
    plain = client.save_weights_external("plain").result().path
    sealed_save = client.save_weights_external(
        "sealed", age_encryption_recipients=[str(identity.to_public())]
    )
    sealed = sealed_save.result().path

    plain_urls = rest.get_external_weights_urls(plain).result().urls
    sealed_urls = rest.get_external_weights_urls(sealed).result().urls
    assert sorted(sealed_urls) == sorted(f"{name}.age" for name in plain_urls)
    for name, url in plain_urls.items():
        expected = httpx.get(url, timeout=60).content
        encrypted = httpx.get(sealed_urls[f"{name}.age"], timeout=60).content
        assert encrypted != expected and pyrage.decrypt(encrypted, [identity]) == expected
    listed = {
        c.tinker_path: c.size_bytes for c in rest.list_checkpoints(client.model_id).result().checkpoints
    }
    assert listed[sealed] == sum(p.stat().st_size for p in checkpoint_dir(engine, sealed).rglob("*.age"))

    with pytest.raises(tinker.RequestFailedError, match=r"age_encryption_recipients\[0\]"):
        client.save_weights_external("bad", age_encryption_recipients=["age1examplerecipient"]).result()
    with pytest.raises(tinker.RequestFailedError, match="age_encryption_recipients"):
        client.save_weights_external("none", age_encryption_recipients=[]).result()
    # Refused before anything was written, in turn: the client goes on.
    assert not checkpoint_dir(engine, f"tinker://{client.model_id}/external_weights/bad").exists()
    client.save_weights_external("after").result()
    assert seq_gaps(engine, client.model_id) == []


def test_create_via_load_makes_a_new_model_and_nothing_else(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    client = trained(service, seed=7)
    state = client.save_state("base").result().path
    loaded = service.create_training_client_from_state_with_optimizer(
        state, user_metadata={"k": "v"}
    ).result()
    assert loaded.model_id != client.model_id
    np.testing.assert_array_equal(probe(loaded), probe(client))
    assert rest.get_training_run(loaded.model_id).result().user_metadata == {"k": "v"}

    with pytest.raises(tinker.RequestFailedError, match="base_model"):
        service.create_training_client_from_state(state, base_model="other-model").result()
    with pytest.raises((tinker.BadRequestError, tinker.RequestFailedError), match="weights_access_token"):
        service.create_training_client_from_state(state, weights_access_token="tok").result()
    session_id = session_of(client.model_id)
    seq = int(client.model_id.rsplit(":", 1)[1])
    before = probe(client)
    # A load addressed to a model that exists is no create: it fails and the model keeps its weights.
    other = trained(service, seed=8).save_state("other").result().path
    taken = post(
        engine,
        "load_weights",
        {"session_id": session_id, "model_seq_id": seq, "path": other, "optimizer": False},
    )
    outcome = post(engine, "retrieve_future", {"request_id": taken.json()["request_id"]}).json()
    assert "already exists" in outcome["error"]
    np.testing.assert_array_equal(probe(client), before)
    bad = [
        {"session_id": session_id, "path": state, "optimizer": False},
        {"session_id": session_id, "model_seq_id": -2, "path": state, "optimizer": False},
        {
            "model_id": client.model_id,
            "session_id": session_id,
            "model_seq_id": 5,
            "path": state,
            "optimizer": False,
        },
    ]
    for body in bad:
        answer = post(engine, "load_weights", body)
        assert answer.status_code == 400, body
