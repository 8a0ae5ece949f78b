"""The tinkerrpc API's rules in one place: every fixed bound and default (`limits`), the loss table
(`losses`), the advantage-estimator and loss-aggregation tables (`estimators`), the per-token terms of
an RL Train (`train_terms`: KL penalty, distillation, per-token advantages, truncated importance
sampling) and the sampling-options table (`sampling`). The service's validation, the sidecar's request
models, the engine's loss checks, the SDK's client-side checks and the ART backend read them; the docs'
tables are generated from them (`limits_markdown()`, `losses_markdown()`, `estimators_markdown()`,
`sampling_options_markdown()`, `train_terms_markdown()`);
tests/foundation/test_contract.py fails when any layer's default or bound differs from the table's.

A leaf package: the standard library only, so the light SDK imports it without torch, tinker or fastapi.

Why Python tables, not protovalidate rules in the .proto files (measured for issue 38): protovalidate's
current PyPI release (2.1) runs on buf's own Python protobuf runtime (protobuf-py), not the
google.protobuf messages grpcio and the generated tinkerrpc.v1 code use. Its 1.x line does take them,
but adds cel-python, google-re2, lark, pendulum, PyYAML, jmespath and dateutil (several MB) and needs
buf/validate/validate.proto from the Buf Schema Registry. Compiled here, one SamplingParams with three
rules took 583 ms to import, 110 ms for the first check and 16.8 ms per message after that (its CEL
interpreter is pure Python), where the hand-written `check_sampling_params` takes 8 us. Beyond the cost:
the bounds that matter most are not static: n and max_tokens are server flags (--max-sample-n,
--max-sample-tokens), token ids are checked against the model's vocabulary and lengths against its
context, and errors must be the project's google.rpc BadRequest messages naming the field and the flag.
The light SDK checks arguments before any call without an extra runtime; other languages learn the
server's bounds from GetServerInfo's `limits` and get the same field violations from the server.

Adding a loss:
1. Its `LossFunction` value in protos/tinkerrpc/v1/types.proto (`LOSS_FUNCTION_<NAME>`), then
   `python scripts/generate_protos.py`.
2. One row in `losses.LOSSES` (inputs, config keys with default and range, rl, objective), and its
   name in `losses.LossName` (and `RLLossName` for an RL loss) for the type checker.
3. Its math: a torch function in `tinkerrpc_server.engine.losses.LOSS_FUNCTIONS` and a numpy one in
   `tinkerrpc_server.service.step_loss.LOSS_OF_DATUM`, both under the row's name.
A config key Train should set also needs its optional field in `LossConfig` (named as the key).
"""

from tinkerrpc.contract.estimators import estimators_markdown
from tinkerrpc.contract.limits import limits_markdown
from tinkerrpc.contract.losses import losses_markdown
from tinkerrpc.contract.sampling import sampling_options_markdown
from tinkerrpc.contract.train_terms import train_terms_markdown

__all__ = [
    "estimators_markdown",
    "limits_markdown",
    "losses_markdown",
    "sampling_options_markdown",
    "train_terms_markdown",
]
