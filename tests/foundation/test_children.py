"""Child processes of the bottom layer (processes.children), with real children: the ports a child
reports once it serves, its exit before it serves or past the deadline, the exit awaited without
polling, and the SIGTERM-then-SIGKILL stop."""

from __future__ import annotations

import asyncio
import os
import signal
import socket
import sys
import time

import pytest

from tinkerrpc_server.processes.children import ChildProcess, StartError
from tinkerrpc_server.processes.http_serving import bound_port, listen

pytestmark = pytest.mark.process

# A child that binds port 0 and reports the port it got, as the servers do, then serves until stopped.
SERVING = """
import socket, sys, time
from tinkerrpc_server.processes.children import report_ready
sock = socket.socket(); sock.bind(("127.0.0.1", 0)); sock.listen()
report_ready(int(sys.argv[-1]), {"port": sock.getsockname()[1]})
conn, _ = sock.accept(); conn.sendall(b"hello"); conn.close()
time.sleep(600)
"""


def _child(code: str, name: str = "child") -> ChildProcess:
    # The report fd is appended after the script: `python -c CODE --report-fd N`.
    return ChildProcess([sys.executable, "-c", code], {}, name)


def test_the_reported_port_is_where_the_child_serves() -> None:
    child = _child(SERVING)
    try:
        ports = child.wait_ready(60)
        with socket.create_connection(("127.0.0.1", ports["port"]), timeout=10) as conn:
            assert conn.recv(5) == b"hello"
        assert child.exit_code() is None
    finally:
        assert child.stop(10) == -15


def test_a_child_that_exits_before_reporting_fails_at_once_with_its_code() -> None:
    child = _child("import sys; sys.exit(3)", "quitter")
    started = time.monotonic()
    with pytest.raises(StartError, match="quitter exited with code 3") as failed:
        child.wait_ready(600)
    assert failed.value.exit_code == 3
    assert time.monotonic() - started < 300  # learnt from the closed pipe, not the deadline


def test_a_child_that_never_reports_times_out_and_keeps_running() -> None:
    child = _child("import time; time.sleep(600)", "silent")
    try:
        with pytest.raises(StartError, match="silent not ready after 1 s") as failed:
            child.wait_ready(1)
        assert failed.value.exit_code is None and child.exit_code() is None
    finally:
        child.stop(10)


@pytest.mark.parametrize(
    "report",
    ['b"not json\\n"', "b'{\"port\": 70000}\\n'", 'b\'{"port": "80"}\\n\''],
    ids=["text", "range", "type"],
)
def test_a_report_that_names_no_ports_is_refused(report: str) -> None:
    child = _child(f"import os, sys, time; os.write(int(sys.argv[-1]), {report}); time.sleep(600)")
    try:
        with pytest.raises(StartError, match="not its ports"):
            child.wait_ready(60)
    finally:
        child.stop(10)


def test_the_exit_is_awaited() -> None:
    child = _child("import time; time.sleep(600)")

    async def await_exit() -> int:
        waiting = asyncio.create_task(child.exited())
        await asyncio.sleep(0)
        assert not waiting.done()
        os.kill(child.pid, signal.SIGTERM)  # the exit the waiter learns of
        return await asyncio.wait_for(waiting, 60)

    assert asyncio.run(await_exit()) == -15
    assert child.exit_code() == -15
    # Once exited, it is known at once.
    assert asyncio.run(child.exited()) == -15


def test_a_child_ignoring_sigterm_is_killed_after_the_grace() -> None:
    code = "import signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
    code += (
        "from tinkerrpc_server.processes.children import report_ready; report_ready(int(sys.argv[-1]), {}); "
    )
    code += "time.sleep(600)"
    child = _child(code, "stubborn")
    assert child.wait_ready(60) == {}
    assert child.stop(0.5) == -9


def test_listen_binds_port_zero_to_a_free_port_and_refuses_one_in_use() -> None:
    with listen("127.0.0.1", 0) as first:
        port = bound_port(first)
        assert port > 0
        with pytest.raises(OSError):
            listen("127.0.0.1", port)
