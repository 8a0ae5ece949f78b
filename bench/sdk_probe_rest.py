"""The SDK probe's RestClient and AdminClient calls, and weights_access_token wherever it is taken (see
sdk_probe_core)."""

from __future__ import annotations

import datetime as dt

import tinker
from tinker import types

from bench.sdk_probe_core import (
    TINY,
    Probe,
    Refused,
    call,
    expect,
    expect_close,
    expect_refused,
    fingerprint,
    train_step,
)


@call("RestClient.list_training_runs(limit, offset, access_scope)")
def _runs(p: Probe) -> None:
    p.trained  # noqa: B018 - at least one run
    every = p.rest.list_training_runs(limit=100).result().training_runs
    expect(any(r.training_run_id == p.trained.model_id for r in every), "the trained run is not listed")
    rest = p.rest.list_training_runs(limit=100, offset=1, access_scope="accessible").result().training_runs
    expect([r.training_run_id for r in rest] == [r.training_run_id for r in every[1:]], "offset")
    owned = p.rest.list_training_runs(limit=100, access_scope="owned").result().training_runs
    expect([r.training_run_id for r in owned] == [r.training_run_id for r in every], "owned runs")


@call("RestClient.get_training_run(training_run_id, access_scope) / get_training_run_by_tinker_path")
def _run(p: Probe) -> None:
    run = p.rest.get_training_run(p.trained.model_id, access_scope="owned").result()
    expect(run.base_model == TINY and run.lora_rank == 4, f"{run}")
    by_path = p.rest.get_training_run_by_tinker_path(p.state_path, access_scope="owned").result()
    expect(by_path.training_run_id == p.trained.model_id, "by path")


@call("RestClient.list_checkpoints / list_user_checkpoints(limit, offset)")
def _checkpoints(p: Probe) -> None:
    paths = {p.state_path, p.sampler_path}
    listed = {c.tinker_path for c in p.rest.list_checkpoints(p.trained.model_id).result().checkpoints}
    expect(paths <= listed, f"{paths - listed} not listed")
    everyone = p.rest.list_user_checkpoints(limit=1000).result().checkpoints
    expect(paths <= {c.tinker_path for c in everyone}, "list_user_checkpoints")
    later = p.rest.list_user_checkpoints(limit=1000, offset=1).result().checkpoints
    expect(len(later) == len(everyone) - 1, "offset")


@call("RestClient.get_weights_info_by_tinker_path")
def _weights_info(p: Probe) -> None:
    info = p.rest.get_weights_info_by_tinker_path(p.state_path).result()
    expect(info.base_model == TINY and info.lora_rank == 4 and info.is_lora, f"{info}")


@call("RestClient.set_checkpoint_ttl_from_tinker_path(tinker_path, ttl_seconds)")
def _ttl(p: Probe) -> None:
    path = p.trained.save_state("ttl").result().path

    def expires() -> object:
        listed = {c.tinker_path: c for c in p.rest.list_checkpoints(p.trained.model_id).result().checkpoints}
        return listed[path].expires_at

    p.rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    expect(expires() is not None, "ttl not set")
    p.rest.set_checkpoint_ttl_from_tinker_path(path, None).result()
    expect(expires() is None, "ttl not cleared")


@call("RestClient.delete_checkpoint(training_run_id, checkpoint_id) / delete_checkpoint_from_tinker_path")
def _delete(p: Probe) -> None:
    a = p.trained.save_state("gone-a").result().path
    b = p.trained.save_weights_for_sampler("gone-b").result().path
    p.rest.delete_checkpoint(p.trained.model_id, "weights/gone-a").result()
    p.rest.delete_checkpoint_from_tinker_path(b).result()
    listed = {c.tinker_path for c in p.rest.list_checkpoints(p.trained.model_id).result().checkpoints}
    expect(not {a, b} & listed, "deleted checkpoints still listed")


@call("RestClient.publish_checkpoint_from_tinker_path / unpublish_checkpoint_from_tinker_path")
def _publish(p: Probe) -> None:
    path = p.trained.save_weights_for_sampler("pub").result().path

    def public() -> bool | None:
        listed = {c.tinker_path: c for c in p.rest.list_checkpoints(p.trained.model_id).result().checkpoints}
        return listed[path].public

    p.rest.publish_checkpoint_from_tinker_path(path).result()
    expect(public() is True, "not public after publish")
    p.rest.unpublish_checkpoint_from_tinker_path(path).result()
    expect(public() is False, "still public after unpublish")


@call("RestClient.copy_weights(path, destination_project_id)")
def _rest_copy(p: Probe) -> None:
    copied = p.rest.copy_weights(p.state_path, destination_project_id="probe-project").result()
    expect_close(fingerprint(p.service.create_training_client_from_state(copied).result()), p.at_save, "copy")


@call("RestClient.get_sampler(sampler_id)")
def _get_sampler(p: Probe) -> None:
    sampler = p.service.create_sampling_client(model_path=p.sampler_path).result()
    sampler_id = sampler._sampling_session_id
    got = p.rest.get_sampler(sampler_id).result()
    expect(got.base_model == TINY and got.model_path == p.sampler_path, f"{got}")


@call("RestClient.get_server_capabilities")
def _rest_capabilities(p: Probe) -> None:
    names = [m.model_name for m in p.rest.get_server_capabilities().result().supported_models]
    expect(TINY in names, f"{names}")


def _session_id(p: Probe) -> str:
    return p.service.holder.get_session_id()


@call("RestClient.list_sessions(limit, offset, access_scope) / get_session(session_id, access_scope)")
def _sessions(p: Probe) -> None:
    p.trained  # noqa: B018
    sessions = p.rest.list_sessions(limit=100, access_scope="owned").result().sessions
    expect(
        _session_id(p) in [getattr(s, "session_id", s) for s in sessions], f"own session not in {sessions}"
    )
    got = p.rest.get_session(_session_id(p), access_scope="owned").result()
    expect(p.trained.model_id in got.training_run_ids, f"{got}")
    expect(p.rest.list_sessions(limit=100, offset=1).result().sessions == sessions[1:], "offset")
    accessible = p.rest.list_sessions(limit=100, access_scope="accessible").result().sessions
    expect(accessible == sessions, "a local engine's sessions are all its user's")
    expect(p.rest.get_session(_session_id(p), access_scope="accessible").result() == got, "accessible")


@call("RestClient.search_sessions(SessionSearchRequest)")
def _search(p: Probe) -> None:
    found = p.rest.search_sessions(types.SessionSearchRequest(session_id=_session_id(p))).result()
    expect(len(found.sessions) == 1, f"{found}")


@call("RestClient.assign_session_project / export_session_trace")
def _project_trace(p: Probe) -> None:
    p.rest.assign_session_project(_session_id(p), "probe-project").result()
    runs = p.rest.list_training_runs(limit=100, project_id="probe-project").result().training_runs
    expect(any(r.training_run_id == p.trained.model_id for r in runs), "project filter")
    trace = p.rest.export_session_trace(_session_id(p)).result()
    expect(isinstance(trace, str) and len(trace) > 0, "empty trace")


@call("RestClient.whoami")
def _whoami(p: Probe) -> None:
    me = p.rest.whoami().result()
    expect(bool(me.user_urn), f"{me}")


def _usage_calls(owner: str) -> None:
    def client(p: Probe) -> tinker.RestClient | tinker.AdminClient:
        return p.rest if owner == "RestClient" else p.admin

    @call(f"{owner}.get_audit_log(event_type, day)", slug=f"{owner}_audit_log")
    def _audit(p: Probe) -> None:
        p.trained.save_state(f"audit-{owner}").result()
        entries = client(p).get_audit_log().result().entries
        expect(len(entries) > 0, "an empty audit log after saves")
        today = client(p).get_audit_log(event_type="checkpoints", day=dt.date.today()).result().entries
        expect(len(today) > 0 and all(e.event.startswith("checkpoint") for e in today), "checkpoint events")
        projects = client(p).get_audit_log(event_type="projects").result().entries
        expect(all(e.event.startswith("project") for e in projects), f"{[e.event for e in projects]}")
        for event_type in ("teams", "organizations"):  # a local engine has neither
            expect(client(p).get_audit_log(event_type=event_type).result().entries == [], event_type)

    @call(f"{owner}.get_billing_usage(starting_on, ending_before)", slug=f"{owner}_billing_usage")
    def _billing(p: Probe) -> None:
        hour = dt.datetime.now(dt.timezone.utc).replace(minute=0, second=0, microsecond=0)
        usage = (
            client(p).get_billing_usage(hour - dt.timedelta(days=1), hour + dt.timedelta(hours=1)).result()
        )
        expect(usage.data == [] and not usage.sessions, f"a local engine bills nothing: {usage}")

    @call(f"{owner}.get_current_checkpoint_storage_usage(project_id)", slug=f"{owner}_storage_usage")
    def _storage(p: Probe) -> None:
        p.state_path  # noqa: B018
        usage = client(p).get_current_checkpoint_storage_usage().result()
        expect(usage.data is not None, f"{usage}")


_usage_calls("RestClient")
_usage_calls("AdminClient")


@call("AdminClient.get_telemetry / RestClient.get_telemetry")
def _telemetry(p: Probe) -> None:
    p.admin.get_telemetry()
    p.rest.get_telemetry()


@call(
    "RestClient.get_training_run(access_scope='accessible') / get_training_run_by_tinker_path(access_scope)"
)
def _run_accessible(p: Probe) -> None:
    run = p.rest.get_training_run(p.trained.model_id, access_scope="accessible").result()
    by_path = p.rest.get_training_run_by_tinker_path(p.state_path, access_scope="accessible").result()
    expect(run.training_run_id == by_path.training_run_id == p.trained.model_id, f"{run} {by_path}")


@call("SessionSearchRequest(user_metadata, owner=OwnSearchOwner, statuses=[Active|Cancelled|Failed])")
def _search_filters(p: Probe) -> None:
    mine = _session_id(p)

    def found(**fields: object) -> list[str]:
        request = types.SessionSearchRequest(session_id=mine, **fields)  # type: ignore[arg-type]
        return [s.session_id for s in p.rest.search_sessions(request).result().sessions]

    expect(found(owner=types.OwnSearchOwner()) == [mine], "own sessions")
    expect(found(statuses=[types.ActiveSessionStatusQuery()]) == [mine], "an active session")
    expect(found(statuses=[types.CancelledSessionStatusQuery()]) == [], "not cancelled")
    expect(found(statuses=[types.FailedSessionStatusQuery()]) == [], "not failed")
    expect(found(user_metadata={"no": "such"}) == [], "metadata filter")
    # A cursor rebuilt from its fields leads to the same page.
    request = types.SessionSearchRequest(limit=1, owner=types.AccessibleSearchOwner())
    cursor = p.rest.search_sessions(request).result().next_cursor
    if cursor is not None:
        rebuilt = types.SessionSearchCursor(
            last_created_at=cursor.last_created_at, last_session_id=cursor.last_session_id
        )
        pages = [
            p.rest.search_sessions(request.model_copy(update={"cursor": c})).result()
            for c in (cursor, rebuilt)
        ]
        expect(pages[0].sessions == pages[1].sessions, "the rebuilt cursor")


@call("weights_access_token on every call that takes it (refused: one organisation)")
def _access_token(p: Probe) -> None:
    token = "tok"
    client = p.new_model(seed=17)
    archive = tinker.ServiceClient(
        project_id="probe-archive", base_url=p.engine.base_url, api_key=p.engine.api_key
    )
    refusals = [
        lambda: p.service.create_training_client_from_state(p.state_path, weights_access_token=token),
        lambda: p.service.create_training_client_from_state_with_optimizer(
            p.state_path, weights_access_token=token
        ),
        lambda: archive.copy_weights(p.state_path, weights_access_token=token),
        lambda: p.rest.copy_weights(p.state_path, "probe-project", weights_access_token=token),
        lambda: client.load_state(p.state_path, weights_access_token=token),
        lambda: client.load_state_with_optimizer(p.state_path, weights_access_token=token),
    ]
    with archive:
        for request in refusals:
            expect_refused(lambda request=request: request().result(), "weights_access_token")
    train_step(client)  # the refused loads did not poison the client (run_call checks for seq gaps)
    raise Refused("weights_access_token: 400 naming the field on every call that takes it")
