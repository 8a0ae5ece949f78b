"""One owner per data dir and port, and a sidecar never more open than its server (issue 16, items 2
and 3), tried with real processes as a careless user or a local attacker would:

- a second `serve` on a data dir or port in use, or a second `engine` on an engine's data dir, exits at
  start with one line naming the owner, and the owner keeps serving with its model untouched (before,
  both trained the same model, or shared the port through SO_REUSEPORT and took turns answering);
- `--auth-token` with `--sidecar-port` and no sidecar key refuses to start; `--sidecar-no-auth` starts
  with a warning;
- the sidecar reaches a TLS server over TLS (hosted, trusting the server's own certificate; standalone
  with `--grpc-tls-ca`), and its /health says why when the server refuses its token.
"""

from __future__ import annotations

import re
import subprocess
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import openai
import pytest

import tinkerrpc
from tinkerrpc_server.local.stack import LocalEngine, LocalProcess, LocalSidecar, LocalStack
from tinkerrpc_server.settings import AUTH_TOKEN_ENV

pytestmark = pytest.mark.process

TINY = "tinkerrpc/tiny-chat"
TOKEN = "ownership-test-token"
START_TIMEOUT = 240.0
PROMPT = [tinkerrpc.Message.user("who owns this data dir?")]


def _only_line(log: str) -> str:
    lines = [line for line in log.splitlines() if line.strip()]
    assert len(lines) == 1 and "Traceback" not in log, f"one line expected:\n{log}"
    return lines[0]


def _refused(process: LocalProcess) -> tuple[int, str]:
    """Start `process`, which must exit at start: its exit code and its one line of output."""
    with pytest.raises(RuntimeError, match="exited with"):
        process.start()
    return process.wait(10), _only_line(process.log())


def _named_pid(line: str) -> int:
    match = re.search(r"\(pid (\d+)\)", line)
    assert match, line
    return int(match.group(1))


def _command_line(pid: int) -> list[str]:
    return Path(f"/proc/{pid}/cmdline").read_bytes().decode().split("\0")


@dataclass
class Owner:
    """The first `serve`, with a model trained one step, and what its model looked like then."""

    stack: LocalStack
    model_dir: Path
    client: tinkerrpc.Client
    info: tinkerrpc.ModelInfo
    prompt_logprobs: tuple[float, ...]

    def model_state(self) -> tuple[tinkerrpc.ModelInfo, tuple[float, ...]]:
        model = self.client.model("owned")
        [sample] = model.sample(PROMPT, max_tokens=1, include_prompt_logprobs=True, seed=1)
        return model.info(), sample.prompt_logprobs[1:]  # the first token has none (NaN)

    def assert_untouched(self) -> None:
        assert self.model_state() == (self.info, self.prompt_logprobs)


@pytest.fixture(scope="module")
def owner(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Owner]:
    tmp = tmp_path_factory.mktemp("owner")
    model_dir = tmp / "models"
    stack = LocalStack(
        tmp / "data", tmp / "serve.log", ("--model-dir", str(model_dir)), startup_timeout=START_TIMEOUT
    ).start()
    client = tinkerrpc.Client(stack.target)
    model = client.create_model("owned", base_model=TINY, lora_rank=4)
    model.train_supervised([[*PROMPT, tinkerrpc.Message.assistant("I do")]], learning_rate=1e-2)
    found = Owner(stack, model_dir, client, model.info(), ())
    found.info, found.prompt_logprobs = found.model_state()
    assert found.info.policy_version == 1
    yield found
    client.close()
    assert stack.stop() == 0


def test_second_serve_on_the_data_dir_exits_naming_the_owner(owner: Owner, tmp_path: Path) -> None:
    data_dir = owner.stack.data_dir
    second = LocalStack(data_dir, tmp_path / "second.log", ("--model-dir", str(owner.model_dir)))
    code, line = _refused(second)
    assert code == 1 and "cannot start" in line and str(data_dir) in line, line
    # The PID named is the running owner: `tinkerrpc serve` on that data dir (its port is its own pick).
    command = _command_line(_named_pid(line))
    assert _named_pid(line) == owner.stack.pid and "serve" in command and str(data_dir) in command
    owner.assert_untouched()
    trained = owner.client.model("owned").train_supervised(
        [[*PROMPT, tinkerrpc.Message.assistant("still I")]], learning_rate=1e-2
    )
    assert trained.policy_version == 2
    owner.info, owner.prompt_logprobs = owner.model_state()


def test_second_serve_on_the_port_exits_and_calls_reach_the_owner_only(owner: Owner, tmp_path: Path) -> None:
    port = owner.stack.port
    # The later --port wins: the second server asks for the owner's port.
    second = LocalStack(
        tmp_path / "data", tmp_path / "second.log", ("--model-dir", str(owner.model_dir), "--port", str(port))
    )
    code, line = _refused(second)
    assert code == 1 and "cannot start" in line and f"port {port}" in line and "in use" in line, line
    assert not (tmp_path / "data" / "engine").exists(), "no engine child was started"
    # No process can share the port, even one asking for SO_REUSEPORT (gRPC's default): the owner bound
    # it without. Before, the second server bound it too and new connections alternated between them.
    intruder = grpc.server(ThreadPoolExecutor(max_workers=1))
    with pytest.raises(RuntimeError, match="Failed to bind"):
        intruder.add_insecure_port(f"127.0.0.1:{port}")
    for _ in range(8):  # fresh connections: each would be load-balanced by the kernel if shared
        with tinkerrpc.Client(owner.stack.target) as client:
            assert [m.name for m in client.list_models()] == ["owned"]
    owner.assert_untouched()


def test_engines_own_their_data_dir(owner: Owner, tmp_path: Path) -> None:
    # The serve's engine child owns <data dir>/engine: a standalone engine there is refused, naming it.
    match = re.search(r"embedded engine starting \(pid (\d+)\)", owner.stack.log())
    assert match, "the server log names its engine child"
    engine_dir = owner.stack.data_dir / "engine"
    code, line = _refused(LocalEngine(engine_dir, owner.model_dir, tmp_path / "intruder.log"))
    assert code == 1 and str(engine_dir) in line and _named_pid(line) == int(match.group(1)), line
    owner.assert_untouched()

    # Two standalone engines on one data dir: the second exits at start, naming the first.
    with LocalEngine(tmp_path / "engine-data", owner.model_dir, tmp_path / "first.log") as first:
        code, line = _refused(LocalEngine(tmp_path / "engine-data", owner.model_dir, tmp_path / "second.log"))
        assert code == 1 and "cannot start" in line, line
        command = _command_line(_named_pid(line))
        assert _named_pid(line) == first.pid and "engine" in command
        assert first.is_ready()


def test_sidecar_without_key_is_refused_when_the_server_needs_a_token(tmp_path: Path) -> None:
    server = LocalStack(
        tmp_path / "data",
        tmp_path / "serve.log",
        ("--model-dir", str(tmp_path / "models"), "--auth-token", TOKEN),
        with_sidecar=True,
    )
    code, line = _refused(server)
    assert code == 2 and "--sidecar-api-key" in line and "--sidecar-no-auth" in line, line
    assert TOKEN not in line


@dataclass
class TlsServer:
    """A TLS `serve` with a token, hosting a sidecar without a key (--sidecar-no-auth)."""

    stack: LocalStack
    cert: Path
    client: tinkerrpc.Client


@pytest.fixture(scope="module")
def tls_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[TlsServer]:
    tmp = tmp_path_factory.mktemp("tls")
    cert, key = tmp / "cert.pem", tmp / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    args = ("--auth-token", TOKEN, "--tls-cert", str(cert), "--tls-key", str(key), "--sidecar-no-auth")
    # Ready only once the hosted sidecar's /health passes: over TLS, with the server's token.
    stack = LocalStack(
        tmp / "data",
        tmp / "serve.log",
        ("--model-dir", str(tmp / "models"), *args),
        startup_timeout=START_TIMEOUT,
        tls_root_certificates=cert.read_bytes(),
        with_sidecar=True,
    ).start()
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    client = tinkerrpc.Client(f"localhost:{stack.port}", token=TOKEN, tls=credentials)
    client.create_model("tls-chat", base_model=TINY, lora_rank=4)
    yield TlsServer(stack, cert, client)
    client.close()
    assert stack.stop() == 0


def test_hosted_sidecar_reaches_a_tls_server(tls_server: TlsServer) -> None:
    assert tls_server.stack.sidecar_url is not None
    api = openai.OpenAI(base_url=f"{tls_server.stack.sidecar_url}/v1", api_key="none", max_retries=0)
    completion = api.chat.completions.create(
        model="tls-chat", messages=[{"role": "user", "content": "hi"}], max_tokens=4, seed=1
    )
    assert completion.model == "tls-chat@0" and completion.choices[0].message.content is not None
    log = tls_server.stack.log()
    warnings = [line for line in log.splitlines() if "WARNING" in line and "no API key" in line]
    assert len(warnings) == 1, log
    # First contact: the log says where each door is.
    assert re.search(rf"serving gRPC on 127\.0\.0\.1:{tls_server.stack.port} \(TLS, bearer token", log)
    assert f"OpenAI sidecar on {tls_server.stack.sidecar_url}/v1" in log
    assert TOKEN not in log


def _standalone_sidecar(tls_server: TlsServer, log: Path, token: str) -> LocalSidecar:
    """Not started yet: entering it starts it."""
    sidecar = LocalSidecar(f"127.0.0.1:{tls_server.stack.port}", log)
    sidecar.cmd += ["--grpc-tls-ca", str(tls_server.cert), "--grpc-server-name", "localhost"]
    sidecar.env[AUTH_TOKEN_ENV] = token
    return sidecar


def test_standalone_sidecar_over_tls_and_its_health_with_a_refused_token(
    tls_server: TlsServer, tmp_path: Path
) -> None:
    with _standalone_sidecar(tls_server, tmp_path / "sidecar.log", TOKEN) as sidecar:
        health = httpx.get(f"{sidecar.base_url}/health", timeout=30)
        assert (health.status_code, health.json()) == (200, {"status": "ok"})
        api = openai.OpenAI(base_url=sidecar.openai_base_url, api_key="none", max_retries=0)
        assert "tls-chat" in {m.id for m in api.models.list()}
    with _standalone_sidecar(tls_server, tmp_path / "wrong.log", "wrong-" + TOKEN) as sidecar:
        health = httpx.get(f"{sidecar.base_url}/health", timeout=30)
        assert health.status_code == 503, health.text
        body = health.json()
        assert body["status"] == "unavailable" and body["reason"] == "UNAUTHENTICATED", body
        assert body["detail"], body
