"""Several optimizer steps inside one Train (TrainRequest.minibatch_size, supervised examples only).

The examples are taken in order, minibatch_size at a time; each minibatch is one forward_backward and one
optim_step (its own learning rate when minibatch_learning_rates is given), and the Train still commits
one policy version with one sampler save: ART's SFT ends in one checkpoint however many batches it
trained, and a warm-up of many small steps pays for its saves once. The steps' outputs are combined as
the tinker SDK combines a chunked forward_backward (`loss:sum` added, `:mean` weighted by datums), so a
minibatched Train's loss is the sum of its minibatches' losses, each taken at the weights it trained."""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import tinker
from tinker.lib.chunked_fwdbwd_helpers import REDUCE_MAP, combine_fwd_bwd_output_results

from tinkerrpc.v1 import trainer_service_pb2
from tinkerrpc_server.service.datums import Batch
from tinkerrpc_server.service.errors import Violations
from tinkerrpc_server.service.train_options import learning_rate_problem


@dataclass(frozen=True)
class Minibatch:
    """One optimizer step of a Train: datums[start:stop] and the Adam settings it steps with."""

    start: int
    stop: int
    adam: tinker.types.AdamParams


def check_minibatches(v: Violations, request: trainer_service_pb2.TrainRequest) -> None:
    rates = request.minibatch_learning_rates
    if not request.HasField("minibatch_size"):
        if rates:
            v.add("minibatch_learning_rates", "needs minibatch_size")
        return
    if request.groups:
        v.add("minibatch_size", "applies to supervised examples; an RL Train is one optimizer step")
    if request.minibatch_size < 1:
        v.add("minibatch_size", f"must be >= 1, got {request.minibatch_size}")
        return
    count = math.ceil(len(request.examples) / request.minibatch_size)
    if rates and len(rates) != count:
        v.add(
            "minibatch_learning_rates",
            f"{len(rates)} learning rates for {count} minibatches of {request.minibatch_size} examples",
        )
        return  # each rate is checked once there is one per minibatch (at most one per example)
    for i, rate in enumerate(rates):
        problem = learning_rate_problem(rate)
        if problem is not None:
            v.add(f"minibatch_learning_rates[{i}]", problem)


def plan(
    request: trainer_service_pb2.TrainRequest, batch: Batch, adam: tinker.types.AdamParams
) -> list[Minibatch]:
    """The Train's optimizer steps, in order. A minibatch whose examples rendered to no datum is skipped."""
    if not request.HasField("minibatch_size"):
        return [Minibatch(0, len(batch.datums), adam)]
    size, rates, ends = request.minibatch_size, request.minibatch_learning_rates, batch.example_ends
    steps: list[Minibatch] = []
    start = 0
    for k, first in enumerate(range(0, len(ends), size)):
        stop = ends[min(first + size, len(ends)) - 1]
        if stop > start:
            rate = rates[k] if rates else adam.learning_rate
            steps.append(Minibatch(start, stop, adam.model_copy(update={"learning_rate": rate})))
        start = stop
    return steps


def combined_forward_backward(
    outputs: Sequence[tinker.types.ForwardBackwardOutput],
) -> tinker.types.ForwardBackwardOutput:
    return outputs[0] if len(outputs) == 1 else combine_fwd_bwd_output_results(outputs)


def combined_optim_metrics(metrics: Sequence[dict[str, float] | None]) -> dict[str, float]:
    """The optim steps' metrics by the reduction each name carries ("grad_norm:mean": their mean)."""
    present = [m for m in metrics if m]
    if len(present) <= 1:
        return dict(present[0]) if present else {}
    combined: dict[str, float] = {}
    for key in present[0]:
        reduction = key.rpartition(":")[2]
        values = [m[key] for m in present if key in m]
        if reduction in REDUCE_MAP and reduction != "unique" and len(values) == len(present):
            combined[key] = float(REDUCE_MAP[reduction](values))  # type: ignore[arg-type]
    return combined
