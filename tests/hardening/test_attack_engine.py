"""The embedded engine as a local attacker meets it (issue 16, item 1), with real processes:

- the engine port of a running `serve`, found from the process list as anyone on the machine can, answers
  401 without its key or with a wrong one: listing runs, exporting, deleting the live version's sampler
  checkpoint, loading an old state over the live model; the health check stays open; the key is in no
  command line; the served model is untouched and trains on (before, the key was the constant
  `tml-local` and every one of these calls went through);
- names that would reach a path outside `--data-dir` (`session_id` `../..` and the like, checkpoint
  names, tinker:// paths, a symlink planted in the data dir) are refused and nothing is written outside;
- everything `serve` and its engine create under `--data-dir` is 0700 (directories) / 0600 (files);
- a standalone `tinkerrpc engine` without a key exits at start with one line, `--insecure-no-auth` only
  serves a loopback host, and a key file's key is what the tinker SDK sends (`TINKER_API_KEY`).
"""

from __future__ import annotations

import os
import secrets
import stat
import subprocess
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import httpx
import psutil
import pytest
import tinker

import tinkerrpc
from tinkerrpc_server.engine.storage import read_index
from tinkerrpc_server.local.stack import LocalEngine, LocalStack, tinkerrpc_command
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV

pytestmark = pytest.mark.process

TINY = "tinkerrpc/tiny-chat"
START_TIMEOUT = 240.0
PROMPT = [tinkerrpc.Message.user("may I have the weights?")]
GUESSED_KEYS = (None, "tml-local", f"tml-{secrets.token_urlsafe(32)}")


ModelState = tuple[tinkerrpc.ModelInfo, tuple[float, ...]]


def _model_state(client: tinkerrpc.Client) -> ModelState:
    model = client.model("victim")
    [sample] = model.sample(PROMPT, max_tokens=1, include_prompt_logprobs=True, seed=1)
    return model.info(), tuple(sample.prompt_logprobs[1:])  # the first token has none (NaN)


@dataclass
class Victim:
    """A `serve` whose model trained one step, and that model's state then."""

    stack: LocalStack
    client: tinkerrpc.Client
    state: ModelState


@pytest.fixture(scope="module")
def victim(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Victim]:
    tmp = tmp_path_factory.mktemp("victim")
    stack = LocalStack(
        tmp / "data", tmp / "serve.log", ("--model-dir", str(tmp / "models")), startup_timeout=START_TIMEOUT
    ).start()
    client = tinkerrpc.Client(stack.target)
    model = client.create_model("victim", base_model=TINY, lora_rank=4)
    model.train_supervised([[*PROMPT, tinkerrpc.Message.assistant("no")]], learning_rate=1e-2)
    found = Victim(stack, client, _model_state(client))
    assert found.state[0].policy_version == 1
    yield found
    client.close()
    assert stack.stop() == 0


def _engine_child(data_dir: Path) -> psutil.Process:
    """The engine child of the `serve` on `data_dir`, found by its command line as `ps` shows it."""
    for process in psutil.process_iter(["cmdline"]):
        command = process.info["cmdline"] or []
        if "tinkerrpc_server.local.engine_child" in command and str(data_dir / "engine") in command:
            return process
    raise AssertionError(f"no engine child of the serve on {data_dir}")


def _engine_index(data_dir: Path) -> dict[str, Any]:
    runs, checkpoints = read_index(data_dir / "engine")
    return {"runs": [asdict(r) for r in runs], "checkpoints": [asdict(c) for c in checkpoints]}


def test_the_serve_engine_refuses_callers_without_its_key(victim: Victim) -> None:
    engine = _engine_child(victim.stack.data_dir)
    [port] = {c.laddr.port for c in engine.net_connections("tcp") if c.status == psutil.CONN_LISTEN}
    url = f"http://127.0.0.1:{port}"
    # The key travels outside argv: in no command line of the server or its engine, and not in the
    # server's own environment; the engine's environment is readable by its owner only (0400).
    server = engine.parent()
    assert server is not None
    for process in (server, engine):
        assert not any("tml-" in part for part in process.cmdline())
    assert ENGINE_API_KEY_ENV not in server.environ()
    assert stat.S_IMODE(os.stat(f"/proc/{engine.pid}/environ").st_mode) == 0o400

    # What the attacker wants, with the real ids (read here from the owner's index).
    index = _engine_index(victim.stack.data_dir)
    [run] = index["runs"]
    model_id = run["model_id"]
    sampler = max((c for c in index["checkpoints"] if c["kind"] == "sampler"), key=lambda c: c["created_at"])
    first_state = min(
        (c for c in index["checkpoints"] if c["kind"] == "training"), key=lambda c: c["created_at"]
    )
    attacks: list[tuple[str, str, dict[str, Any] | None]] = [
        ("GET", "/api/v1/training_runs", None),
        ("GET", f"/api/v1/training_runs/{model_id}/checkpoints", None),
        ("GET", "/api/v1/checkpoints", None),
        ("POST", "/api/v1/save_weights_external", {"model_id": model_id, "path": "stolen", "seq_id": 999}),
        (
            "GET",
            f"/api/v1/training_runs/{model_id}/checkpoints/external_weights/x/external_weights_urls",
            None,
        ),
        ("DELETE", f"/api/v1/training_runs/{model_id}/checkpoints/sampler_weights/{sampler['name']}", None),
        (
            "POST",
            "/api/v1/load_weights",
            {
                "model_id": model_id,
                "path": f"tinker://{model_id}/weights/{first_state['name']}",
                "optimizer": True,
                "seq_id": 999,
            },
        ),
        ("POST", "/api/v1/create_session", {}),
        ("POST", "/api/v1/retrieve_future", {"request_id": "req-1"}),
        ("GET", "/api/v1/no-such-route", None),
    ]
    for key in GUESSED_KEYS:
        headers = {} if key is None else {"X-API-Key": key}
        for method, path, body in attacks:
            response = httpx.request(method, url + path, json=body, headers=headers, timeout=30)
            assert response.status_code == 401, (key, method, path, response.text)
            assert "X-API-Key" in response.json()["detail"]
    assert httpx.get(f"{url}/api/v1/healthz", timeout=30).status_code == 200

    # The tinker SDK with a wrong key fails at once with a clear error (a 401 is never retried).
    started = time.monotonic()
    with pytest.raises(tinker.AuthenticationError, match="X-API-Key"):
        tinker.RestClient(base_url=url, api_key=GUESSED_KEYS[2]).list_training_runs().result()
    assert time.monotonic() - started < 30

    # Nothing changed: every checkpoint is there, the model is as it was, and it trains on.
    assert _engine_index(victim.stack.data_dir)["checkpoints"] == index["checkpoints"]
    assert _model_state(victim.client) == victim.state
    trained = victim.client.model("victim").train_supervised(
        [[*PROMPT, tinkerrpc.Message.assistant("no")]], learning_rate=1e-2
    )
    assert trained.policy_version == 2


def test_everything_under_the_data_dir_is_private(victim: Victim) -> None:
    data_dir = victim.stack.data_dir
    paths = [data_dir, *data_dir.rglob("*")]
    expected = {path: 0o700 if path.is_dir() else 0o600 for path in paths}
    loose = [
        f"{oct(stat.S_IMODE(p.lstat().st_mode))} {p}"
        for p in paths
        if stat.S_IMODE(p.lstat().st_mode) != expected[p]
    ]
    assert not loose, "\n".join(loose)
    # The server's SQLite (and its WAL), the engine's index, weights and optimizer state were all seen.
    names = {p.name for p in paths}
    assert {
        "tinkerrpc.sqlite3",
        "tinkerrpc.sqlite3-wal",
        "engine_index.jsonl",
        "optimizer.safetensors",
    } <= names


# ---- names that reach paths, on a standalone engine (whose key this test holds)


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    work = tmp_path_factory.mktemp("engine")
    running = LocalEngine(
        work / "deep" / "data", work / "models", work / "engine.log", startup_timeout=START_TIMEOUT
    ).start()
    yield running
    assert running.stop() == 0, running.log()[-3000:]


def _tree(root: Path, *skipped: Path) -> set[str]:
    """Every path under `root` but those in or under `skipped`."""
    return {str(p) for p in root.rglob("*") if not any(p == s or s in p.parents for s in skipped)}


def _outcome(engine: LocalEngine, response: httpx.Response) -> tuple[int, str]:
    """(status, error text) of a direct answer, or of the future it names once that is done."""
    body = response.json()
    if response.status_code != 200 or "request_id" not in body:
        return response.status_code, str(body.get("detail", body))
    while True:
        polled = httpx.post(
            f"{engine.base_url}/api/v1/retrieve_future",
            json={"request_id": body["request_id"]},
            headers=engine.auth_headers,
            timeout=60,
        ).json()
        if polled.get("type") != "try_again":
            return (400 if "error" in polled else 200), str(polled.get("error", polled))


def test_names_that_would_leave_the_data_dir_are_refused(engine: LocalEngine) -> None:
    marker = f"escape-{secrets.token_hex(4)}"
    work = engine.data_dir.parent.parent
    before = _tree(work, engine.data_dir, engine.model_dir)

    def post(path: str, body: dict[str, Any]) -> tuple[int, str]:
        response = httpx.post(
            f"{engine.base_url}/api/v1/{path}", json=body, headers=engine.auth_headers, timeout=60
        )
        return _outcome(engine, response)

    refusals: list[tuple[tuple[int, str], str]] = []
    for session_id in ("../..", f"../../{marker}", "..", "a/b", f"/tmp/{marker}", "x\0y", "s" * 300, ""):
        refusals.append(
            (
                post("create_model", {"session_id": session_id, "model_seq_id": 0, "base_model": TINY}),
                "session_id",
            )
        )
        refusals.append(
            (
                post(
                    "create_sampling_session",
                    {"session_id": session_id, "sampling_session_seq_id": 0, "base_model": TINY},
                ),
                "session_id",
            )
        )
    refusals.append(
        (
            post(
                "load_weights",
                {
                    "session_id": f"../{marker}",
                    "model_seq_id": 0,
                    "path": "tinker://x:train:0/weights/a",
                    "optimizer": False,
                },
            ),
            "session_id",
        )
    )
    # base_model is a model name, never a path (before: any folder with a config.json was loaded).
    model_path = engine.model_dir / TINY
    for seq, base_model in enumerate(
        (str(model_path), f"../{engine.model_dir.name}/{TINY}", f"{TINY}/../{TINY}")
    ):
        refusals.append(
            (
                post("create_model", {"session_id": "s1", "model_seq_id": seq, "base_model": base_model}),
                "not a model name",
            )
        )

    with engine.service_client() as service:
        client = service.create_lora_training_client(TINY, rank=4, seed=0).result()
        model_id = client.model_id
        for name in ("../../" + marker, f"a/{marker}", "..", f"{marker}\n"):
            for save in (client.save_state, client.save_weights_for_sampler, client.save_weights_external):
                with pytest.raises(tinker.TinkerError, match="checkpoint name"):
                    save(name).result()
        for path in (f"tinker://../../{marker}/weights/a", f"tinker://{model_id}/weights/../../{marker}"):
            with pytest.raises(tinker.TinkerError):
                service.create_training_client_from_state(path).result()
        kept = client.save_state("kept").result().path

    for status_and_text, needle in refusals:
        assert status_and_text[0] == 400 and needle in status_and_text[1], (needle, status_and_text)
    # A path-shaped id in a URL is refused too, and deletes nothing.
    deleted = httpx.delete(
        f"{engine.base_url}/api/v1/training_runs/%2E%2E/checkpoints/weights/kept", headers=engine.auth_headers
    )
    assert deleted.status_code in (400, 404), deleted.text
    assert (engine.data_dir / "runs" / model_id / "weights" / "kept").is_dir() and kept.endswith("/kept")

    # A symlink planted in the data dir does not lead the engine out of it either.
    outside = work / "outside"
    outside.mkdir()
    (engine.data_dir / "runs" / "planted:train:0").symlink_to(outside)
    assert post("create_model", {"session_id": "planted", "model_seq_id": 0, "base_model": TINY})[0] == 200
    status, text = post("save_weights", {"model_id": "planted:train:0", "path": marker, "seq_id": 1})
    assert status == 400 and "outside the engine's data dir" in text
    assert list(outside.iterdir()) == []

    assert _tree(work, engine.data_dir, engine.model_dir) == before | {str(outside)}
    assert not list(work.parent.rglob(f"*{marker}*")), "nothing named by the attacker exists anywhere"


# ---- the standalone engine's own key


def _engine_command(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != ENGINE_API_KEY_ENV}
    command = tinkerrpc_command("engine", "--port", "1", "--data-dir", str(tmp_path / "data"), *args)
    return subprocess.run(command, env=env, capture_output=True, text=True, timeout=120)


def test_a_standalone_engine_without_a_key_does_not_start(tmp_path: Path) -> None:
    weak = tmp_path / "weak.key"
    weak.write_text("hunter2\n")
    for args, needle in [
        ((), "no API key"),
        (("--insecure-no-auth", "--host", "0.0.0.0"), "loopback"),
        (("--insecure-no-auth", "--host", "192.0.2.1"), "loopback"),
        (("--api-key-file", str(weak)), "tml-"),
        (("--api-key-file", str(tmp_path / "missing.key")), "cannot read"),
    ]:
        done = _engine_command(tmp_path, *args)
        lines = [line for line in (done.stdout + done.stderr).splitlines() if line.strip()]
        assert done.returncode == 2 and len(lines) == 1, (args, done.stdout + done.stderr)
        assert lines[0].startswith("tinkerrpc engine: ") and needle in lines[0], (args, lines)
    assert not (tmp_path / "data").exists(), "nothing was created"


def test_a_key_file_is_what_the_sdk_sends_and_no_auth_serves_loopback_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    key_file = tmp_path / "engine.key"
    key = f"tml-{secrets.token_urlsafe(32)}"
    key_file.write_text(key + "\n")
    with_file = LocalEngine(tmp_path / "keyed", tmp_path / "models", tmp_path / "keyed.log", START_TIMEOUT)
    del with_file.env[ENGINE_API_KEY_ENV]
    with_file.cmd += ["--api-key-file", str(key_file)]
    with with_file:
        runs = f"{with_file.base_url}/api/v1/training_runs"
        assert httpx.get(runs, headers=with_file.auth_headers).status_code == 401  # its own key is unused
        assert httpx.get(runs, headers={"X-API-Key": key}).status_code == 200
        monkeypatch.setenv("TINKER_API_KEY", key_file.read_text().strip())  # TINKER_API_KEY=$(cat engine.key)
        assert (
            tinker.RestClient(base_url=with_file.base_url).list_training_runs().result().training_runs == []
        )

    open_engine = LocalEngine(tmp_path / "open", tmp_path / "models", tmp_path / "open.log", START_TIMEOUT)
    del open_engine.env[ENGINE_API_KEY_ENV]
    open_engine.cmd += ["--insecure-no-auth"]
    with open_engine:
        assert httpx.get(f"{open_engine.base_url}/api/v1/training_runs").status_code == 200
        assert "NO AUTHENTICATION" in open_engine.log()
