"""SaveCheckpoint / ListCheckpoints / RestoreCheckpoint / DeleteCheckpoint and what they do to sampling."""

from __future__ import annotations

import grpc
import pytest
from svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    error_info,
    prompt_logprobs,
    resource_info,
    rl_request,
    sample_chat,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

MODEL = "ckpt-model"
STATE = types_pb2.CHECKPOINT_KIND_STATE
SAMPLER = types_pb2.CHECKPOINT_KIND_SAMPLER


def _train(server: Server, seed: int) -> int:
    sample = sample_chat(server.stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=seed)
    return server.stub.Train(rl_request(MODEL, sample, [1.0, 0.0]), timeout=CALL_TIMEOUT).policy_version


def _checkpoints(server: Server) -> list[tuple[str, int, int]]:
    listed = server.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=MODEL)).checkpoints
    return [(c.name, c.kind, c.policy_version) for c in listed]


def test_checkpoint_lifecycle(server: Server) -> None:
    create_model(server.stub, MODEL)
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)
    assert _train(server, 1) == 1
    at_one = prompt_logprobs(server.stub, MODEL, probe)
    saved = server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="good")).checkpoint
    assert (saved.name, saved.kind, saved.policy_version, saved.automatic) == ("good", STATE, 1, False)
    assert saved.tinker_path.startswith("tinker://")
    with pytest.raises(grpc.RpcError) as err:
        server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="good"))
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    # The default name at the current version is the automatic checkpoint of this step.
    default = server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL)).checkpoint
    assert (default.name, default.policy_version) == ("step_000001", 1)

    assert _train(server, 2) == 2
    assert _train(server, 3) == 3
    assert prompt_logprobs(server.stub, MODEL, probe) != pytest.approx(at_one, abs=1e-6)
    listed = _checkpoints(server)
    for version in range(4):
        assert (f"v{version:06d}", SAMPLER, version) in listed
        assert (f"step_{version:06d}", STATE, version) in listed
    assert ("good", STATE, 1) in listed

    # Delete a sampler: that version is no longer sampleable; the current one cannot be deleted.
    server.stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(model=MODEL, checkpoint="v000002", kind=SAMPLER))
    with pytest.raises(grpc.RpcError) as err:
        sample_chat(server.stub, MODEL, "hi", version=2)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert resource_info(err.value).resource_name == f"{MODEL}@2"
    with pytest.raises(grpc.RpcError) as err:
        server.stub.DeleteCheckpoint(
            pb.DeleteCheckpointRequest(model=MODEL, checkpoint="v000003", kind=SAMPLER)
        )
    assert error_info(err.value).reason == "CURRENT_SAMPLER_CHECKPOINT"
    with pytest.raises(grpc.RpcError) as err:
        server.stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(model=MODEL, checkpoint="nope"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    server.stub.DeleteCheckpoint(pb.DeleteCheckpointRequest(model=MODEL, checkpoint="step_000002"))
    assert ("step_000002", STATE, 2) not in _checkpoints(server)
    model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
    assert list(model.sampleable_versions) == [0, 1, 3]

    # Restore: back to version 1 with its weights; later samplers are gone; training continues from there.
    restored = server.stub.RestoreCheckpoint(
        pb.RestoreCheckpointRequest(model=MODEL, checkpoint="good"), timeout=CALL_TIMEOUT
    ).model
    assert restored.policy_version == 1 and list(restored.sampleable_versions) == [0, 1]
    assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(at_one, abs=1e-5)
    with pytest.raises(grpc.RpcError) as err:
        sample_chat(server.stub, MODEL, "hi", version=3)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert _train(server, 4) == 2
    assert ("step_000002", STATE, 2) in _checkpoints(server)
    with pytest.raises(grpc.RpcError) as err:
        server.stub.RestoreCheckpoint(pb.RestoreCheckpointRequest(model=MODEL, checkpoint="missing"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
