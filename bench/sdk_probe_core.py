"""What the SDK probe's calls share: the call registry, the verdicts, and the probe's fixtures (a fresh engine
on tiny-chat, its clients, one trained model with a saved state and sampler checkpoint).

A call is made as a user makes it with the unmodified tinker SDK, then checked against Tinker's semantics:
it *works* when it answers and the check holds, is *refused* when the engine turns it down as documented
(a clear error naming what it refuses), *fails* on any other error, and is *silently wrong* when it
answers but the check finds the answer is not what Tinker's SDK defines.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import numpy as np
import tinker
from tinker import types

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import TINY_CHAT

Verdict = Literal["works", "refused", "fails", "silently wrong"]
VERDICTS: tuple[Verdict, ...] = ("works", "refused", "fails", "silently wrong")
TINY = TINY_CHAT
ADAM = types.AdamParams(learning_rate=1e-2)
PROMPT = types.ModelInput.from_ints([5, 17, 42, 8, 99, 23])


class SilentlyWrong(AssertionError):
    """The call answered, but not with Tinker's semantics."""


class Refused(Exception):
    """The engine refused the call as documented: a clear error naming what it refuses."""


@dataclass(frozen=True)
class Call:
    slug: str  # a short unique id: the test parametrized over the calls names each by it
    name: str  # what it calls, with which options: `Client.method(options)`
    run: Callable[[Probe], None]


CALLS: list[Call] = []


def call(name: str, slug: str = "") -> Callable[[Callable[[Probe], None]], Callable[[Probe], None]]:
    """Register a call under `name`; its slug is the function's name unless given."""

    def register(run: Callable[[Probe], None]) -> Callable[[Probe], None]:
        one = Call(slug or run.__name__.strip("_"), name, run)
        assert all(c.slug != one.slug and c.name != name for c in CALLS), one
        CALLS.append(one)
        return run

    return register


def expect(condition: bool, message: str) -> None:
    if not condition:
        raise SilentlyWrong(message)


def expect_close(got: Any, want: Any, what: str, atol: float = 1e-4) -> None:
    got_array, want_array = np.asarray(got, dtype=np.float64), np.asarray(want, dtype=np.float64)
    expect(
        got_array.shape == want_array.shape and np.allclose(got_array, want_array, atol=atol),
        f"{what}: {got_array.tolist()} != {want_array.tolist()}",
    )


def refusal_or(future: Callable[[], Any], *fragments: str) -> Any:
    """The call's answer; a refusal whose message names every fragment becomes Refused."""
    try:
        return future()
    except (tinker.RequestFailedError, tinker.APIStatusError) as error:
        if all(f in str(error) for f in fragments):
            raise Refused(str(error)[:200]) from error
        raise


def expect_refused(future: Callable[[], Any], *fragments: str) -> str:
    """A request that must be refused naming every fragment (bad input): its message."""
    try:
        future()
    except (tinker.RequestFailedError, tinker.APIStatusError) as error:
        expect(all(f in str(error) for f in fragments), f"refused without naming {fragments}: {error}")
        return str(error)
    raise SilentlyWrong(f"accepted what must be refused (naming {fragments})")


def datum(tokens: list[int], weights: list[float] | None = None) -> types.Datum:
    n = len(tokens) - 1
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.asarray(weights if weights is not None else [1.0] * n, dtype=np.float32),
        },
    )


BATCH = [datum([11, 42, 17, 99, 23, 5]), datum([7, 8, 9, 10], [0.0, 1.0, 1.0])]
FINGERPRINT = [datum([31, 32, 33, 34, 35, 36, 37])]


def fingerprint(client: tinker.TrainingClient) -> np.ndarray:
    """The model's logprobs on a fixed datum: its weights' fingerprint (forward changes nothing)."""
    out = client.forward(FINGERPRINT, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def train_step(client: tinker.TrainingClient, params: Any = ADAM) -> float:
    loss = float(client.forward_backward(BATCH, "cross_entropy").result().metrics["loss:sum"])
    client.optim_step(params).result()
    return loss


@dataclass
class Probe:
    """The fixtures every call may use. `trained` has taken one step; `state_path` and `sampler_path`
    hold its weights after it, `at_save` their fingerprint."""

    engine: LocalEngine
    service: tinker.ServiceClient
    rest: tinker.RestClient = field(init=False)
    admin: tinker.AdminClient = field(init=False)

    def __post_init__(self) -> None:
        self.rest = self.service.create_rest_client()
        self.admin = tinker.AdminClient(base_url=self.engine.base_url, api_key=self.engine.api_key)

    def new_model(self, seed: int = 3, **options: Any) -> tinker.TrainingClient:
        return self.service.create_lora_training_client(TINY, rank=4, seed=seed, **options).result()

    @functools.cached_property
    def trained(self) -> tinker.TrainingClient:
        client = self.new_model(seed=1)
        train_step(client)
        return client

    @functools.cached_property
    def state_path(self) -> str:
        return self.trained.save_state("probe-state").result().path

    @functools.cached_property
    def sampler_path(self) -> str:
        return self.trained.save_weights_for_sampler("probe-sampler").result().path

    @functools.cached_property
    def at_save(self) -> np.ndarray:
        self.state_path, self.sampler_path  # noqa: B018 - saved before the fingerprint is taken
        return fingerprint(self.trained)

    @functools.cached_property
    def base_sampler(self) -> tinker.SamplingClient:
        return self.service.create_sampling_client(base_model=TINY).result()


def _seq_gaps(engine: LocalEngine) -> list[str]:
    """The engine's log lines of a training client's seq_id that never arrived: a request the engine
    answered without taking its turn, so the client's next request waited out the gap timeout."""
    return [line for line in engine.log().splitlines() if "never arrived" in line]


def run_call(one: Call, probe: Probe) -> tuple[Verdict, str]:
    gaps_before = len(_seq_gaps(probe.engine))
    try:
        one.run(probe)
    except SilentlyWrong as wrong:
        return "silently wrong", str(wrong)[:300]
    except Refused as refusal:
        verdict: Verdict = "refused"
        detail = str(refusal)
    except Exception as error:  # the verdict: whatever the SDK raised is the call failing
        return "fails", f"{type(error).__name__}: {error}"[:300]
    else:
        verdict, detail = "works", ""
    gaps = _seq_gaps(probe.engine)[gaps_before:]
    if gaps:
        return "silently wrong", f"a request left its seq_id unanswered: {gaps[0][-120:]}"
    return verdict, detail


def run_all(probe: Probe, calls: list[Call]) -> Iterator[tuple[Call, Verdict, str]]:
    for one in calls:
        verdict, detail = run_call(one, probe)
        yield one, verdict, detail
