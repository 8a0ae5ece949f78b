"""ART (OpenPipe's Agent Reinforcement Trainer) on tinkerrpc: `pip install 'tinkerrpc[art]'`.

ART code runs unchanged but for its backend line:

    from tinkerrpc.art import TinkerRPCBackend
    backend = TinkerRPCBackend("127.0.0.1:50051")  # instead of LocalBackend() / TinkerNativeBackend()
    model = art.TrainableModel(name="agent-001", project="yes-no-maybe", base_model="Qwen/Qwen3-4B")
    await model.register(backend)  # gets or creates the tinkerrpc model "agent-001"
    client = model.openai_client()  # the sidecar the server hosts (`serve --sidecar-port`)
    ...
    result = await backend.train(model, groups, learning_rate=1e-5)

This module imports `art`; `import tinkerrpc` never does.
"""

try:
    import art  # noqa: F401 - only to name the extra when ART is absent
except ImportError as err:
    raise ImportError("tinkerrpc.art needs ART: pip install 'tinkerrpc[art]'") from err

from tinkerrpc.art._backend import TinkerRPCBackend

__all__ = ["TinkerRPCBackend"]
