"""A minibatched supervised Train on the real engine (`tinkerrpc serve` and its engine child, tiny-chat):
the weights it commits are those of a Train per minibatch at the same rates, its minibatch losses are
those Trains' losses, and it is one version with one sampler checkpoint."""

from __future__ import annotations

import pytest
from svc import CALL_TIMEOUT, Server, create_model, prompt_logprobs, yes_no_sft_request

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

RATES = [2e-2, 1e-2, 5e-3]
PROBE = [11, 23, 35, 47, 59, 71, 83, 95]
# The CPU engine is deterministic: the same steps give the same weights.
TOLERANCE = 1e-6


def test_a_minibatched_train_is_the_trains_of_its_minibatches(server: Server) -> None:
    separate, together = "minibatch-separate", "minibatch-together"
    create_model(server.stub, separate)
    create_model(server.stub, together)
    losses = [
        server.stub.Train(yes_no_sft_request(separate, rate), timeout=CALL_TIMEOUT).metrics.loss
        for rate in RATES
    ]

    request = yes_no_sft_request(together, RATES[0])
    examples = list(request.examples)
    for _ in RATES[1:]:
        request.examples.extend(examples)
    request.minibatch_size = len(examples)
    request.minibatch_learning_rates.extend(RATES)
    response = server.stub.Train(request, timeout=CALL_TIMEOUT)

    assert response.policy_version == 1
    assert list(response.metrics.minibatch_losses) == pytest.approx(losses, rel=1e-5)
    assert prompt_logprobs(server.stub, together, PROBE) == pytest.approx(
        prompt_logprobs(server.stub, separate, PROBE), abs=TOLERANCE
    )
    listed = server.stub.ListCheckpoints(pb.ListCheckpointsRequest(model=together), timeout=CALL_TIMEOUT)
    samplers = [c for c in listed.checkpoints if c.kind == types_pb2.CHECKPOINT_KIND_SAMPLER]
    assert sorted(c.policy_version for c in samplers) == [0, 1]
