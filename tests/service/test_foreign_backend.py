"""The service on a Tinker-compatible backend that is not Tinker (the in-process fake with its switches,
fake_backend.py): a loss computed from the returned logprobs when no `loss:sum` comes, a refused restore
that changes nothing, pruning by the listing's path form when the backend refuses the answered one, and
checkpoint kinds named in words; and `serve --tinker-url` at a URL that answers 500 stops with one line."""

from __future__ import annotations

import logging
import math
import subprocess
import sys
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import grpc
import pytest
from fake_backend import RETURNED_LOGPROB, FakeTinker
from in_process import InProcessService

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.exporting import Exporter
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.rendering import ChatCodecs

pytestmark = pytest.mark.process


async def test_the_loss_comes_from_the_returned_logprobs_without_loss_sum(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(reports_loss_sum=False), codecs)
    await service.create("m")
    metrics = (await service.train("m", "hello")).metrics
    # cross_entropy with 0/1 weights: minus the returned logprob once per trained token.
    assert metrics.trained_tokens > 0
    assert math.isclose(metrics.loss, -RETURNED_LOGPROB * metrics.trained_tokens, rel_tol=1e-6)


async def test_a_refused_restore_leaves_the_model_training_on_its_live_client(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    fake = FakeTinker()
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs)
    await service.create("m")
    await service.train("m", "step 1")
    await service.checkpoints.save(pb.SaveCheckpointRequest(model="m", name="mark"))
    await service.train("m", "step 2")
    live = await service.training_client("m")
    made = len(fake.clients)
    fake.fail_next.add("create_training_client_from_state_with_optimizer")
    with pytest.raises(LookupError, match="refused"):
        await service.checkpoints.restore(pb.RestoreCheckpointRequest(model="m", checkpoint="mark"))
    response = await service.train("m", "step 3")
    assert response.policy_version == 3
    assert await service.training_client("m") is live
    assert len(fake.clients) == made and live.model_id in fake.live_clients


async def test_export_on_a_backend_without_external_weights_is_one_clear_refusal(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs)
    await service.create("m")
    await service.train("m", "step 1")
    exporter = Exporter(service.store, service.fake.backend(), service.models)
    with pytest.raises(ServiceError) as refused:
        await exporter.fetch(pb.ExportWeightsRequest(model="m"))
    assert refused.value.code == grpc.StatusCode.UNIMPLEMENTED
    message = str(refused.value)
    assert "\n" not in message and "save_weights_external" in message and "answered 404" in message
    # Nothing moved: the model trains on.
    assert (await service.train("m", "step 2")).policy_version == 2


async def test_pruning_retries_a_refused_path_in_the_listings_form_and_says_so_once(
    tmp_path: Path, codecs: ChatCodecs, caplog: pytest.LogCaptureFixture
) -> None:
    fake = FakeTinker(lists_other_path_form=True)
    limits = Limits(keep_sampler_versions=2, keep_state_checkpoints=1)
    service = InProcessService.open(tmp_path / "db.sqlite3", fake, codecs, limits=limits)
    await service.create("m")
    with caplog.at_level(logging.WARNING, logger="tinkerrpc"):
        for i in range(1, 7):
            await service.train("m", f"step {i}")
    assert len(fake.refused_deletes) > 1
    # Every pruned checkpoint is gone from the backend: what remains is what the rows keep.
    assert set(fake.checkpoints) == {c.tinker_path for c in service.store.list_checkpoints("m")}
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "logged once" in warnings[0], warnings


async def test_a_missing_checkpoint_is_named_by_its_kind_in_words(tmp_path: Path, codecs: ChatCodecs) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs)
    await service.create("m")
    for kind, word in (
        (types_pb2.CHECKPOINT_KIND_STATE, "state"),
        (types_pb2.CHECKPOINT_KIND_SAMPLER, "sampler"),
    ):
        with pytest.raises(ServiceError) as info:
            await service.checkpoints.delete(
                pb.DeleteCheckpointRequest(model="m", checkpoint="nope", kind=kind)
            )
        assert f"has no {word} checkpoint 'nope'" in info.value.message
        assert "CHECKPOINT_KIND" not in info.value.message


class _AlwaysFails(BaseHTTPRequestHandler):
    def _answer(self) -> None:
        body = b'{"detail": "backend exploded"}'
        self.send_response(500)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    do_GET = do_POST = _answer

    def log_message(self, format: str, *args: object) -> None:
        pass


@pytest.fixture
def failing_tinker() -> Iterator[str]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), _AlwaysFails)
    serving = threading.Thread(target=server.serve_forever, daemon=True)
    serving.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    serving.join()
    server.server_close()


def test_serve_at_a_tinker_url_that_answers_500_stops_with_one_line(
    tmp_path: Path, failing_tinker: str
) -> None:
    serve = [sys.executable, "-m", "tinkerrpc_server.cli", "serve", "--port", "0"]
    serve += ["--data-dir", str(tmp_path / "data"), "--tinker-url", failing_tinker]
    env = {"TINKER_API_KEY": "tml-not-a-real-key", "PATH": "/usr/bin:/bin", "TINKER_TELEMETRY": "0"}
    done = subprocess.run(serve, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1
    errors = [
        line for line in (done.stdout + done.stderr).splitlines() if "ERROR" in line or "Traceback" in line
    ]
    assert len(errors) == 1, done.stderr
    assert (
        "cannot start: the Tinker at" in errors[0] and "500" in errors[0] and "backend exploded" in errors[0]
    )
