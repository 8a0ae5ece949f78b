"""The remote-Tinker path: `tinkerrpc serve --tinker-url URL` with TINKER_API_KEY set uses a Tinker it did
not start, exactly as it uses Tinker cloud: no engine child to supervise, a full-state checkpoint every 10
steps by default, exports through Tinker's external weights and signed URLs, recovery on restart from
the last state checkpoint. Here that Tinker is a separately started `tinkerrpc engine`, and the hub is
offline: serve finds the tokenizer under its --model-dir.

The service's core runs once in this mode: create, sample, train (supervised and RL), checkpoints,
export, and a SIGKILL of serve followed by recovery (versions after the last state checkpoint are
rebuilt from their step records, see tinkerrpc_server.service's docstring)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from svc import (
    CALL_TIMEOUT,
    Server,
    create_model,
    prompt_logprobs,
    rl_request,
    sample_chat,
    yes_no_sft_request,
)
from test_export import load_plain_peft, peft_prompt_logprobs

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

MODEL = "remote"
# The checkpoint cadence serve uses on Tinker when --checkpoint-every is not given.
TINKER_CHECKPOINT_EVERY = 10


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory, service_model_dir: Path) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("remote-engine")
    with LocalEngine(tmp / "data", service_model_dir, tmp / "engine.log", startup_timeout=240) as running:
        yield running


def _serve(tmp: Path, model_dir: Path, engine: LocalEngine, tag: str) -> Server:
    """`tinkerrpc serve` configured as for Tinker cloud, the engine's URL and key in place of Tinker's."""
    env = {"TINKER_API_KEY": engine.api_key, "HF_HUB_OFFLINE": "1"}
    return Server(tmp / "data", model_dir, tmp / f"serve-{tag}.log", env, "--tinker-url", engine.base_url)


def test_serve_on_a_remote_tinker_trains_exports_and_recovers(
    tmp_path: Path, service_model_dir: Path, engine: LocalEngine
) -> None:
    server = _serve(tmp_path, service_model_dir, engine, "first")
    log = server.proc.log()
    assert f"using the Tinker service at {engine.base_url}" in log
    assert "embedded engine" not in log and not (tmp_path / "data" / "engine").exists()

    assert create_model(server.stub, MODEL).policy_version == 0
    sampled = sample_chat(server.stub, MODEL, "respond with yes or no", n=4, max_tokens=4)
    assert len(sampled.sequences) == 4
    assert all(len(s.logprobs) == len(s.token_ids) > 0 for s in sampled.sequences)
    probe = list(sample_chat(server.stub, MODEL, "respond with maybe", n=1, max_tokens=1).prompt_token_ids)

    responses = [server.stub.Train(yes_no_sft_request(MODEL, 2e-2), timeout=CALL_TIMEOUT)]
    rl_step = rl_request(MODEL, sampled, [1.0, 0.0, 1.0, 0.0])
    responses += [server.stub.Train(rl_step, timeout=CALL_TIMEOUT) for _ in range(TINKER_CHECKPOINT_EVERY)]
    assert [r.policy_version for r in responses] == list(range(1, TINKER_CHECKPOINT_EVERY + 2))
    automatic = [r.policy_version for r in responses if r.HasField("state_checkpoint")]
    assert automatic == [TINKER_CHECKPOINT_EVERY], "Tinker's default cadence: a full state every 10 steps"
    at_ten = prompt_logprobs(server.stub, MODEL, probe, version=TINKER_CHECKPOINT_EVERY)
    at_eleven = prompt_logprobs(server.stub, MODEL, probe)
    assert at_eleven != pytest.approx(at_ten, abs=1e-6)

    # Exported through save_weights_external and the engine's signed URLs, as from Tinker cloud.
    with tinkerrpc.Client(server.proc.target) as client:
        exported = client.model(MODEL).export_weights(tmp_path / "adapter")
    assert exported.policy_version == 11
    plain = load_plain_peft(service_model_dir, exported.directory)
    assert peft_prompt_logprobs(plain, probe) == pytest.approx(at_eleven, abs=1e-4)
    assert list(engine.data_dir.glob("runs/*/external_weights/*")) == [], "the backend's copy is deleted"

    server.proc.kill()
    server.close()

    server = _serve(tmp_path, service_model_dir, engine, "restarted")
    try:
        model = server.stub.GetModel(pb.GetModelRequest(name=MODEL)).model
        assert model.policy_version == TINKER_CHECKPOINT_EVERY + 1, "nothing acknowledged is lost"
        assert list(model.sampleable_versions) == list(range(TINKER_CHECKPOINT_EVERY + 2))
        assert prompt_logprobs(server.stub, MODEL, probe) == pytest.approx(at_eleven, abs=1e-5)
        # The training state of version 11: step_000010 and the replayed step 11.
        kept = server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="kept")).checkpoint
        assert (kept.kind, kept.policy_version) == (
            types_pb2.CHECKPOINT_KIND_STATE,
            TINKER_CHECKPOINT_EVERY + 1,
        )
        assert kept.tinker_path.startswith("tinker://")
        # Training resumes from the recovered weights and optimizer state.
        assert server.stub.Train(rl_step, timeout=CALL_TIMEOUT).policy_version == TINKER_CHECKPOINT_EVERY + 2
    finally:
        assert server.close() == 0, server.proc.log()[-3000:]


def test_sample_stream_on_a_tinker_without_streaming_replays_the_sample(
    tmp_path: Path, service_model_dir: Path, engine: LocalEngine
) -> None:
    """Tinker has no token stream: SampleStream samples whole and replays it, one token per delta."""
    server = _serve(tmp_path, service_model_dir, engine, "stream")
    try:
        with tinkerrpc.Client(server.proc.target) as client:
            client.create_model("streamed", base_model="tinkerrpc/tiny-chat", lora_rank=8)
            model = client.model("streamed")
            options = tinkerrpc.SamplingOptions(
                n=2, max_tokens=12, seed=4, ignore_default_stops=True, top_logprobs=2, return_token_texts=True
            )
            with model.sample_stream("Hello", options) as stream:
                head, *middle, last = list(stream)
            unary = model.sample("Hello", options=options)
        assert head.prompt_token_ids and last.samples is not None
        assert all(len(d.tokens) == 1 for c in middle for d in c.deltas)
        for index, sample in enumerate(last.samples):
            deltas = [d for c in middle for d in c.deltas if d.index == index]
            assert tuple(t for d in deltas for t in d.tokens) == sample.tokens == unary[index].tokens
            assert "".join(d.text for d in deltas) == sample.text
            assert [d.top_logprobs[0] for d in deltas] == list(sample.top_logprobs)
    finally:
        assert server.close() == 0
