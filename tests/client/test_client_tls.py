"""The client over TLS against the in-process fake server, with a certificate the openssl CLI makes (a
subprocess, hence not in the unit tier; test_client_rpc.py holds the rest of the client's RPC tests)."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from fake_trainer import FAST_RETRY, FakeServer

import tinkerrpc

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def tls_files(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[bytes, bytes]]:
    """A self-signed certificate for 127.0.0.1 and localhost, made with the openssl CLI."""
    directory = tmp_path_factory.mktemp("tls")
    key, cert = Path(directory, "key.pem"), Path(directory, "cert.pem")
    subprocess.run(
        [
            *(
                "openssl",
                "req",
                "-x509",
                "-newkey",
                "ec",
                "-pkeyopt",
                "ec_paramgen_curve:prime256v1",
                "-nodes",
            ),
            *("-keyout", str(key), "-out", str(cert), "-days", "1", "-subj", "/CN=localhost"),
            *("-addext", "subjectAltName=IP:127.0.0.1,DNS:localhost"),
        ],
        check=True,
        capture_output=True,
    )
    yield key.read_bytes(), cert.read_bytes()


async def test_bearer_token_reaches_the_server_over_tls(tls_files: tuple[bytes, bytes]) -> None:
    key, cert = tls_files
    name = "over-tls"  # the server is this test's own
    server = FakeServer(
        required_token="t0ken", server_credentials=grpc.ssl_server_credentials([(key, cert)])
    ).start()
    try:
        tls = grpc.ssl_channel_credentials(root_certificates=cert)
        with tinkerrpc.Client(server.target, token="t0ken", tls=tls, retry=FAST_RETRY) as client:
            assert client.create_model(name, base_model="tinkerrpc/tiny-chat").info().name == name
        async with tinkerrpc.AsyncClient(server.target, token="t0ken", tls=tls, retry=FAST_RETRY) as aclient:
            assert name in [m.name for m in await aclient.list_models()]
        assert len(server.trainer.calls) == 3
        assert {c.metadata["authorization"] for c in server.trainer.calls} == {"Bearer t0ken"}
        with pytest.raises(tinkerrpc.UnavailableError):  # plaintext against a TLS port never gets healthy
            tinkerrpc.Client(server.target, token="t0ken", connect_timeout=0.5)
    finally:
        server.stop()
