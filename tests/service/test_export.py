"""ExportWeights: the model's adapter streamed out as a plain PEFT directory, on the shared real server.

The export is checked against the server itself: the downloaded adapter, loaded with plain PEFT on the
same base model, must give the prompt logprobs the server's sampler gives at that policy version.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file
from svc import (
    CALL_TIMEOUT,
    TINY,
    Server,
    create_model,
    error_info,
    prompt_logprobs,
    resource_info,
    rl_request,
    sample_chat,
)
from transformers import AutoModelForCausalLM

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc_server.model_store import resolve_base_model

pytestmark = pytest.mark.process

MODEL = "exported"


@pytest.fixture(scope="module")
def trained(server: Server) -> int:
    """MODEL after one RL step: its adapter differs from the fresh initialisation."""
    create_model(server.stub, MODEL)
    sampled = sample_chat(server.stub, MODEL, "respond with yes or no", n=4, max_tokens=4)
    request = rl_request(MODEL, sampled, [0.0, 1.0, 0.0, 1.0], idempotency_key="export-step")
    return int(server.stub.Train(request, timeout=CALL_TIMEOUT).policy_version)


def load_plain_peft(model_dir: Path, adapter: Path) -> PeftModel:
    """The exported adapter on the base model, loaded by PEFT alone (no tinkerrpc code)."""
    base = AutoModelForCausalLM.from_pretrained(resolve_base_model(TINY, model_dir), dtype=torch.float32)
    return PeftModel.from_pretrained(base, str(adapter)).eval()


def peft_prompt_logprobs(model: PeftModel, tokens: list[int]) -> list[float]:
    """Log-probability of each token after the first, as the server's prompt_logprobs gives them."""
    with torch.no_grad():
        logits = model(torch.tensor([tokens])).logits[0].float()
    picked = torch.log_softmax(logits, dim=-1)[:-1].gather(1, torch.tensor(tokens[1:])[:, None])[:, 0]
    return [float(x) for x in picked]


def export_stream(server: Server, **fields: int) -> list[pb.ExportWeightsResponse]:
    request = pb.ExportWeightsRequest(model=MODEL, **fields)
    return list(server.stub.ExportWeights(request, timeout=CALL_TIMEOUT))


def test_stream_describes_the_export_then_sends_every_byte_in_order(server: Server, trained: int) -> None:
    first, *chunks = export_stream(server)
    assert first.WhichOneof("part") == "weights"
    weights = first.weights
    assert (weights.model, weights.policy_version, weights.base_model) == (MODEL, trained, TINY)
    sizes = {f.path: f.size_bytes for f in weights.files}
    assert {"adapter_config.json", "adapter_model.safetensors"} <= set(sizes)
    assert all(c.WhichOneof("part") == "chunk" for c in chunks)
    received: dict[str, int] = {}
    order: list[str] = []
    for response in chunks:
        chunk = response.chunk
        assert chunk.offset == received.get(chunk.path, 0), "pieces arrive in order, without gaps"
        received[chunk.path] = chunk.offset + len(chunk.data)
        if not order or order[-1] != chunk.path:
            order.append(chunk.path)
    assert received == sizes
    assert order == [f.path for f in weights.files if f.size_bytes], "files one after another, as listed"


def test_exported_adapter_loads_with_plain_peft_and_matches_the_server(
    server: Server, service_model_dir: Path, trained: int, tmp_path: Path
) -> None:
    target = f"127.0.0.1:{server.port}"
    with tinkerrpc.Client(target) as client:
        exported = client.model(MODEL).export_weights(tmp_path / "adapter", expected_policy_version=trained)
    assert exported.policy_version == trained and exported.directory == tmp_path / "adapter"
    assert sorted(p.name for p in exported.directory.iterdir()) == sorted(exported.files)
    assert not list(tmp_path.glob(".adapter.partial-*")), "no staging directory is left behind"

    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    served = prompt_logprobs(server.stub, MODEL, probe, version=trained)
    plain = load_plain_peft(service_model_dir, exported.directory)
    assert peft_prompt_logprobs(plain, probe) == pytest.approx(served, abs=1e-4)
    # The base model alone gives other logprobs: the export carries the trained adapter.
    with plain.disable_adapter():
        assert peft_prompt_logprobs(plain, probe) != pytest.approx(served, abs=1e-4)


def test_async_export_and_refusals(server: Server, trained: int, tmp_path: Path) -> None:
    import asyncio

    async def export_async() -> tinkerrpc.ExportedWeights:
        async with tinkerrpc.AsyncClient(f"127.0.0.1:{server.port}") as client:
            return await client.model(MODEL).export_weights(tmp_path / "async")

    exported = asyncio.run(export_async())
    assert exported.policy_version == trained
    assert (tmp_path / "async" / "adapter_model.safetensors").stat().st_size > 0

    with tinkerrpc.Client(f"127.0.0.1:{server.port}") as client:
        # An existing non-empty directory is refused before anything is sent.
        with pytest.raises(FileExistsError):
            client.model(MODEL).export_weights(tmp_path / "async")
        with pytest.raises(tinkerrpc.FailedPreconditionError):
            client.model(MODEL).export_weights(tmp_path / "stale", expected_policy_version=trained + 5)
        with pytest.raises(tinkerrpc.NotFoundError):
            client.model("no-such-model").export_weights(tmp_path / "missing")
    assert not (tmp_path / "stale").exists() and not (tmp_path / "missing").exists()
    assert not list(tmp_path.glob(".*.partial-*")), "failed exports leave nothing behind"


def test_export_errors_carry_details(server: Server, trained: int) -> None:
    with pytest.raises(grpc.RpcError) as err:
        export_stream(server, expected_policy_version=trained + 1)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err.value)
    assert info.reason == "VERSION_MISMATCH" and info.metadata["current_version"] == str(trained)
    with pytest.raises(grpc.RpcError) as err:
        list(server.stub.ExportWeights(pb.ExportWeightsRequest(model="nope"), timeout=CALL_TIMEOUT))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert resource_info(err.value).resource_name == "nope"
    # Exports leave the model as it was: same version, nothing added to its checkpoints.
    model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
    assert model.policy_version == trained
    kinds = [c.name for c in server.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=MODEL)).checkpoints]
    assert not any(name.startswith("export") for name in kinds)
    # The backend's copies of the exports were deleted once downloaded (the embedded engine keeps
    # checkpoints under <data-dir>/engine/runs/<run>/<kind>/<name>).
    assert list(server.proc.data_dir.glob("engine/runs/*/external_weights/*")) == []


def exported_tensors(directory: Path) -> dict[str, torch.Tensor]:
    return load_file(str(directory / "adapter_model.safetensors"))


def test_an_earlier_version_exports_without_moving_the_model(
    server: Server, service_model_dir: Path, trained: int, tmp_path: Path
) -> None:
    sampled = sample_chat(server.stub, MODEL, "respond with yes or no", n=4, max_tokens=4)
    request = rl_request(MODEL, sampled, [1.0, 0.0, 1.0, 0.0], idempotency_key="export-step-2")
    current = int(server.stub.Train(request, timeout=CALL_TIMEOUT).policy_version)
    assert current == trained + 1
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    logged_before = len(server.proc.log())
    with tinkerrpc.Client(f"127.0.0.1:{server.port}") as client:
        model = client.model(MODEL)
        before = model.export_weights(tmp_path / "current-before")
        earlier = model.export_weights(tmp_path / "earlier", policy_version=trained)
        after = model.export_weights(tmp_path / "current-after", expected_policy_version=current)
        with pytest.raises(tinkerrpc.NotFoundError):
            model.export_weights(tmp_path / "future", policy_version=current + 1)
        assert model.info().policy_version == current

    assert (earlier.policy_version, before.policy_version, after.policy_version) == (
        trained,
        current,
        current,
    )
    plain = load_plain_peft(service_model_dir, earlier.directory)
    assert peft_prompt_logprobs(plain, probe) == pytest.approx(
        prompt_logprobs(server.stub, MODEL, probe, version=trained), abs=1e-4
    )
    # The earlier version is exported by a training client of its own (no deprecated load_state on the
    # model's, which logged the SDK's deprecation at ERROR): nothing is logged as an error.
    logged = server.proc.log()[logged_before:]
    assert " ERROR " not in logged and "DEPRECATED" not in logged, logged[-3000:]
    # The model's training client never moved: exporting the current version again gives the same
    # tensors as before, and they differ from the earlier version's.
    tensors_before, tensors_after = exported_tensors(before.directory), exported_tensors(after.directory)
    assert tensors_before.keys() == tensors_after.keys()
    assert all(torch.equal(tensors_before[k], tensors_after[k]) for k in tensors_before)
    earlier_tensors = exported_tensors(earlier.directory)
    assert not all(torch.equal(tensors_before[k], earlier_tensors[k]) for k in tensors_before)


def test_cli_export_writes_the_directory_and_reports_errors(
    server: Server, trained: int, tmp_path: Path
) -> None:
    command = [sys.executable, "-m", "tinkerrpc_server.cli", "export", "--target", f"127.0.0.1:{server.port}"]
    done = subprocess.run(
        [*command, MODEL, str(tmp_path / "cli")], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith(f"exported {MODEL}@") and "adapter_model.safetensors" in done.stdout
    assert (tmp_path / "cli" / "adapter_config.json").is_file()
    assert f"export {MODEL}@" in done.stderr and " MiB [" in done.stderr, "the download shows progress"
    refused = subprocess.run(
        [*command, "no-such-model", str(tmp_path / "x")], capture_output=True, text=True, timeout=300
    )
    assert refused.returncode == 1 and "no-such-model" in refused.stderr and not (tmp_path / "x").exists()
