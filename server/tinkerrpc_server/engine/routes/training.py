"""Training steps: forward_backward (and forward, its forward_only variant) and optim_step.

forward_backward arrives as protobuf (see protocol); its data, loss and optimizer values are checked on
the compute thread (a body whose datums cannot be read fails there too), so a rejected request still
takes its turn in the model's queue.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.answers import Answer
from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.optimizers import optim_step as run_optim_step
from tinkerrpc_server.engine.provenance import check_provenance
from tinkerrpc_server.engine.routes.common import EngineDep, model_operation

router = APIRouter(prefix="/api/v1")


@router.post("/forward_backward")
async def forward_backward(request: Request, engine: EngineDep) -> types.UntypedAPIFuture:
    raw = protocol.decode_body(await request.body(), request.headers.get("content-encoding"))
    call = protocol.parse_forward_backward(raw)

    def work() -> Answer:
        if call.problem is not None:
            raise EngineUserError(call.problem)
        check_provenance(call.data, call.provenance, engine.sampled, call.loss_fn)
        return engine.live_runtime(call.model_id).forward_backward(
            call.model_id, call.data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only
        )

    name = "forward" if call.forward_only else f"forward_backward[{call.loss_fn}]"
    return model_operation(engine, call.model_id, call.seq_id, name, work)


@router.post("/optim_step")
async def optim_step(request: types.OptimStepRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    model_id = request.model_id
    params = request.optim_params

    def work() -> Answer:
        return types.OptimStepResponse(
            metrics=run_optim_step(engine.live_runtime(model_id), model_id, params)
        )

    return model_operation(engine, model_id, request.seq_id, "optim_step", work)
