"""`tinkerrpc serve --tinker-url` on a Tinker-compatible HTTP backend that is not our engine
(fake_tinker_server.py: no `loss:sum`, no save_weights_external, no session routes past create_session):
the contract in docs/tinker_parity.md as code. Serve creates a model, trains with a loss computed from the
returned logprobs, samples, refuses ExportWeights in one line, and trains on."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_tinker_server import API_KEY, LOGPROB, SAMPLED_TOKEN, FakeTinkerState, running_fake_tinker
from svc import CALL_TIMEOUT, Server, create_model, sample_chat, yes_no_sft_request

from tinkerrpc.v1 import trainer_service_pb2 as pb

pytestmark = pytest.mark.process

MODEL = "foreign"


@pytest.fixture
def fake_tinker() -> Iterator[tuple[str, FakeTinkerState]]:
    with running_fake_tinker() as running:
        yield running


def test_serve_on_a_foreign_tinker_without_loss_sum_export_or_sessions(
    tmp_path: Path, service_model_dir: Path, fake_tinker: tuple[str, FakeTinkerState]
) -> None:
    url, backend = fake_tinker
    env = {"TINKER_API_KEY": API_KEY, "HF_HUB_OFFLINE": "1"}
    server = Server(tmp_path / "data", service_model_dir, tmp_path / "serve.log", env, "--tinker-url", url)
    try:
        assert create_model(server.stub, MODEL).policy_version == 0
        assert list(backend.models.values()) == ["tinkerrpc/tiny-chat"]
        run = next(iter(backend.models))

        sampled = sample_chat(server.stub, MODEL, "respond with yes or no", n=2, max_tokens=3)
        assert [list(s.token_ids) for s in sampled.sequences] == [[SAMPLED_TOKEN] * 3] * 2
        assert all(s.logprobs == pytest.approx([LOGPROB] * 3) for s in sampled.sequences)

        trained = server.stub.Train(yes_no_sft_request(MODEL, 1e-2), timeout=CALL_TIMEOUT)
        assert trained.policy_version == 1 and backend.optim_steps[run] == 1
        assert backend.forward_backward_losses == ["cross_entropy"]
        # No loss:sum came back: cross_entropy over the returned logprobs (every one LOGPROB) with 0/1
        # weights is -LOGPROB per trained token (service/step_loss.py).
        metrics = trained.metrics
        assert metrics.trained_tokens > 0 and math.isfinite(metrics.loss)
        assert metrics.loss == pytest.approx(-LOGPROB * metrics.trained_tokens, rel=1e-6)
        assert trained.sampler_checkpoint.tinker_path in {
            c.tinker_path for c in backend.checkpoints[run].values()
        }
        assert sample_chat(server.stub, MODEL, "again", n=1).sequences[0].policy_version == 1

        on_backend = dict(backend.checkpoints[run])
        with pytest.raises(grpc.RpcError) as refused:
            list(server.stub.ExportWeights(pb.ExportWeightsRequest(model=MODEL), timeout=CALL_TIMEOUT))
        assert refused.value.code() == grpc.StatusCode.UNIMPLEMENTED
        message = refused.value.details() or ""
        assert "\n" not in message and "save_weights_external" in message and "404" in message
        assert backend.checkpoints[run] == on_backend, "a refused export leaves the backend's checkpoints"

        assert server.stub.Train(yes_no_sft_request(MODEL, 1e-2), timeout=CALL_TIMEOUT).policy_version == 2
        assert backend.optim_steps[run] == 2
        assert "/api/v1/save_weights_external" in backend.routes_missed
    finally:
        assert server.close() == 0, server.proc.log()[-3000:]
