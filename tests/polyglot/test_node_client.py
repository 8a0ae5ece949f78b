"""The protos as a contract for non-Python users: a Node.js client (client.mjs, @grpc/grpc-js with
the protos loaded at run time) asks the server what it is (GetServerInfo), creates a model, samples, trains one step, samples the new version and
downloads its adapter through the ExportWeights stream, reads the run history (GetRunHistory) and watches
it (WatchModel: a replayed version, then a Train seen live), against a real `tinkerrpc serve`; a refused
Train's ErrorInfo reason is decoded and named by the ErrorReason enum of the protos."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from google.rpc import status_pb2

from tinkerrpc.v1 import errors_pb2, trainer_service_pb2, trainer_service_pb2_grpc
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.processes.probes import free_port

pytestmark = pytest.mark.ecosystem

NODE_DIR = Path(__file__).parent
NPM_CI_TIMEOUT_S = 300
CLIENT_TIMEOUT_S = 120
SAMPLES_PER_PROMPT = 4
# The server needs a bearer token, as a deployed one does: the client sends it with --token.
AUTH_TOKEN = "polyglot-test-token"
AUTH_METADATA = (("authorization", f"Bearer {AUTH_TOKEN}"),)
# googleapis' google/rpc/*.proto, as googleapis-common-protos installs them beside their Python modules.
GOOGLE_PROTOS_DIR = Path(status_pb2.__file__).parents[2]


def _tool(name: str) -> str:
    path = shutil.which(name)
    if path is None:
        pytest.fail(f"{name} is not on PATH: the polyglot tests need Node.js 18+ and npm")
    return path


@pytest.fixture(scope="module")
def node() -> str:
    """The node binary, with the client's npm dependencies installed from the lock file."""
    node_path = _tool("node")
    if not (NODE_DIR / "node_modules").is_dir():
        install = subprocess.run(
            [_tool("npm"), "ci", "--no-audit", "--no-fund"],
            cwd=NODE_DIR,
            capture_output=True,
            text=True,
            timeout=NPM_CI_TIMEOUT_S,
        )
        if install.returncode != 0:
            pytest.fail(f"npm ci failed ({install.returncode}):\n{install.stdout}\n{install.stderr}")
    return node_path


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    """A `tinkerrpc serve` with its embedded engine; the tiny chat model is generated into a fresh model dir."""
    tmp = tmp_path_factory.mktemp("polyglot")
    with LocalStack(
        tmp / "data", tmp / "serve.log", ("--model-dir", str(tmp / "models"), "--auth-token", AUTH_TOKEN)
    ) as stack:
        yield stack.target


def _run_client(node: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [
            node,
            str(NODE_DIR / "client.mjs"),
            *args,
            "--token",
            AUTH_TOKEN,
            "--google-protos",
            str(GOOGLE_PROTOS_DIR),
        ],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
    )


def _model_names(address: str) -> list[str]:
    with grpc.insecure_channel(address) as channel:
        stub = trainer_service_pb2_grpc.TrainerServiceStub(channel)
        response = stub.ListModels(
            trainer_service_pb2.ListModelsRequest(), timeout=10, metadata=AUTH_METADATA
        )
    return sorted(model.name for model in response.models)


def test_node_client_trains_one_step_and_samples_the_new_version(node: str, target: str) -> None:
    result = _run_client(node, target)
    assert result.returncode == 0, f"node client failed:\n{result.stderr}\n{result.stdout}"
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, result.stdout
    observed: dict[str, Any] = json.loads(lines[0])

    assert observed["versions"] == {
        "created": 0,
        "sampled": 0,
        "trained": 1,
        "retried": 1,
        "current": 1,
        "pinned_sample": 1,
    }
    assert [method for method, _ in observed["rpc_ms"]] == [
        "GetServerInfo",
        "CreateModel",
        "Sample",
        "Train",
        "Train",
        "Train",
        "GetModel",
        "Sample",
        "ExportWeights",
        "GetRunHistory",
        "Train",
    ]
    assert observed["base_model"] == "tinkerrpc/tiny-chat"
    info = observed["server_info"]
    assert info["backend"] == "BACKEND_KIND_EMBEDDED_ENGINE" and info["server_version"]
    assert info["max_top_logprobs"] == 20 and info["max_sample_n"] > 0
    assert {0, 1} <= set(observed["sampleable_versions"])
    assert observed["model"] in _model_names(target)

    samples = observed["samples"]
    assert len(samples) == SAMPLES_PER_PROMPT
    for sample in samples + observed["pinned_samples"]:
        assert 0 < sample["token_ids"] <= 8
        assert sample["logprobs"] == sample["token_ids"]
    assert [sample["policy_version"] for sample in samples] == [0] * SAMPLES_PER_PROMPT
    assert [sample["policy_version"] for sample in observed["pinned_samples"]] == [1, 1]
    assert observed["prompt_tokens"] > 0

    assert len(set(observed["rewards"])) > 1, "the group must carry signal"
    train = observed["train"]
    assert train["replayed_on_retry"] is True
    assert train["trajectories_used"] == SAMPLES_PER_PROMPT
    assert train["trained_tokens"] == sum(sample["token_ids"] for sample in samples)
    assert train["total_tokens"] > train["trained_tokens"]

    # Reusing the idempotency key for another request: the reason, decoded in Node, is the ErrorReason
    # the Python stubs know by the same name and number.
    refused = observed["refused"]
    assert refused["code"] == "FAILED_PRECONDITION"
    assert (refused["reason"], refused["reason_number"]) == (
        "ERROR_REASON_IDEMPOTENCY_KEY_REUSED",
        errors_pb2.ERROR_REASON_IDEMPOTENCY_KEY_REUSED,
    )
    assert refused["domain"] == "tinkerrpc"
    assert refused["metadata"] == {"idempotency_key": observed["idempotency_key"], "policy_version": "1"}

    # The adapter streamed out whole: the files a PEFT loader needs, the model's LoRA rank (default 32).
    export = observed["export"]
    assert (export["policy_version"], export["base_model"]) == (1, "tinkerrpc/tiny-chat")
    assert export["file_sizes"]["adapter_model.safetensors"] > 0
    assert export["lora_rank"] == 32

    # The run history in Node: version 1's metrics and checkpoints; then WatchModel from version 1
    # replays it and delivers the next Train live.
    rewards = observed["rewards"]
    mean = sum(rewards) / len(rewards)
    [step] = observed["history"]
    assert (step["policy_version"], step["trajectories_used"], step["learning_rate"]) == (
        1,
        SAMPLES_PER_PROMPT,
        1e-3,
    )
    assert step["mean_reward"] == pytest.approx(mean)
    assert step["std_reward"] == pytest.approx((sum((r - mean) ** 2 for r in rewards) / len(rewards)) ** 0.5)
    assert "v000001" in step["checkpoints"] and observed["history_next_page_token"] == ""
    assert observed["watched"] == [
        {"kind": "version", "policy_version": 1, "replayed": True, "step_version": 1, "trajectories_used": 4},
        {
            "kind": "version",
            "policy_version": 2,
            "replayed": False,
            "step_version": 2,
            "trajectories_used": 4,
        },
    ]


def test_node_client_reports_a_grpc_error_with_its_code_and_changes_nothing(node: str, target: str) -> None:
    before = _model_names(target)
    result = _run_client(node, target, "--base-model", "no-such-org/no-such-model")
    assert result.returncode == 1
    assert result.stdout == ""
    message = result.stderr.strip()
    assert message.startswith("tinkerrpc node client: CreateModel failed: "), message
    assert "INVALID_ARGUMENT" in message or "NOT_FOUND" in message, message
    assert "no-such-org/no-such-model" in message
    assert _model_names(target) == before


def test_node_client_reports_an_unreachable_server(node: str) -> None:
    result = _run_client(node, f"127.0.0.1:{free_port()}", "--timeout-s", "5")
    assert result.returncode == 1
    assert "GetServerInfo failed: UNAVAILABLE (14)" in result.stderr


def test_node_client_without_the_token_is_refused_unauthenticated(node: str, target: str) -> None:
    env = {name: value for name, value in os.environ.items() if name != "TINKERRPC_AUTH_TOKEN"}
    result = subprocess.run(
        [node, str(NODE_DIR / "client.mjs"), target, "--google-protos", str(GOOGLE_PROTOS_DIR)],
        cwd=NODE_DIR,
        capture_output=True,
        text=True,
        timeout=CLIENT_TIMEOUT_S,
        env=env,
    )
    assert result.returncode == 1
    assert "GetServerInfo failed: UNAUTHENTICATED" in result.stderr, result.stderr
