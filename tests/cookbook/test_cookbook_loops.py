"""tinker-cookbook's supervised and RL loops (`supervised.train.main`, `rl.train.main`, unmodified) against
a `tinkerrpc engine` process: they train, checkpoint, evaluate, resume after a SIGKILL from their own log
dir, and leave nothing ephemeral behind: the loops never close their ServiceClient, so once a loop's
process has ended its session falls silent and the engine finishes it (unloads its training clients and
deletes their unnamed sampler snapshots) after the session timeout.

Each loop runs as the user runs it, in its own process (cookbook_runs.py), told where the engine is
only by TINKER_BASE_URL / TINKER_API_KEY and loading the tokenizer by name with HF_HUB_OFFLINE=1.
"""

from __future__ import annotations

import importlib.metadata
import json
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import tinker

from tinkerrpc_server.engine.snapshots import UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.ecosystem

RUNNER = Path(__file__).with_name("cookbook_runs.py")
STEPS = 8
SAVE_EVERY = 2
KILL_AT_CHECKPOINT = 4
RUN_TIMEOUT = 300.0
# Twice the SDK's heartbeat period, so a live loop's session never lapses; the engine sweeps every 5 s.
SESSION_TIMEOUT = 20.0
# From 0.6 the RL loop evaluates once more after its last step and logs its token totals there, at step STEPS.
COOKBOOK_0_6 = int(importlib.metadata.version("tinker-cookbook").split(".")[1]) >= 6


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    work = tmp_path_factory.mktemp("cookbook-engine")
    with pytest.MonkeyPatch.context() as patch:
        # The engine lays the built-in models out in this hub cache; the loops read them from it.
        patch.setenv("HF_HUB_CACHE", str(work / "hf-hub"))
        running = LocalEngine(
            work / "data",
            work / "models",
            work / "engine.log",
            startup_timeout=180.0,
            session_timeout=SESSION_TIMEOUT,
        )
    running.start()
    yield running
    assert running.stop() == 0, running.log()[-3000:]


def _checkpoints(log_path: Path) -> list[dict[str, Any]]:
    path = log_path / "checkpoints.jsonl"
    if not path.is_file():
        return []
    # Only whole lines: the loop may be appending one right now.
    return [json.loads(line) for line in path.read_text().split("\n")[:-1] if line.strip()]


def _metrics(log_path: Path) -> list[dict[str, Any]]:
    return [
        json.loads(line) for line in (log_path / "metrics.jsonl").read_text().splitlines() if line.strip()
    ]


def _run(
    engine: LocalEngine,
    loop: str,
    log_path: Path,
    *,
    kill_at_checkpoint: int | None = None,
    extra: tuple[str, ...] = (),
) -> None:
    """Run a loop to the end, or SIGKILL it once its checkpoint of batch `kill_at_checkpoint` is recorded."""
    command = [sys.executable, str(RUNNER), loop, str(log_path), "--steps", str(STEPS)]
    command += ["--save-every", str(SAVE_EVERY), "--eval-every", "2", *extra]
    output = log_path.parent / f"{log_path.name}-{loop}-{'killed' if kill_at_checkpoint else 'resumed'}.out"
    with open(output, "wb") as sink:
        process = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT, env=engine.sdk_user_env())
    deadline = time.monotonic() + RUN_TIMEOUT
    try:
        while process.poll() is None and time.monotonic() < deadline:
            if kill_at_checkpoint is not None and any(
                record.get("batch") == kill_at_checkpoint for record in _checkpoints(log_path)
            ):
                process.send_signal(signal.SIGKILL)
                assert process.wait(30) == -signal.SIGKILL
                return
            time.sleep(0.1)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert kill_at_checkpoint is None, (
        f"{loop} ended before its checkpoint {kill_at_checkpoint}:\n{output.read_text()[-3000:]}"
    )
    assert process.returncode == 0, output.read_text()[-5000:]


def _killed_then_resumed(engine: LocalEngine, loop: str, log_path: Path) -> tuple[list[dict[str, Any]], int]:
    """Kill the loop after a checkpoint, run it again on the same log dir: the metrics of both runs and
    how many lines of the killed run they keep before the resumed run's (all of them up to cookbook 0.5;
    0.6 drops the killed run's lines at or past the step it resumes at before logging them again)."""
    _run(engine, loop, log_path, kill_at_checkpoint=KILL_AT_CHECKPOINT)
    killed = _metrics(log_path)
    _run(engine, loop, log_path)
    resumed_output = (log_path.parent / f"{log_path.name}-{loop}-resumed.out").read_text()
    assert "Resumed training from tinker://" in resumed_output
    metrics = _metrics(log_path)
    kept = next(
        (i for i, (before, after) in enumerate(zip(killed, metrics, strict=False)) if before != after),
        min(len(killed), len(metrics)),
    )
    resumed_from = int(metrics[kept]["step"])
    assert all(int(line["step"]) >= resumed_from for line in killed[kept:]), (killed, metrics)
    return metrics, kept


def _assert_resumed_from_checkpoint(metrics: list[dict[str, Any]], killed_lines: int) -> None:
    """The resumed run's step counter continues from the checkpoint, not from 0, up to the last step."""
    steps = [int(line["step"]) for line in metrics[killed_lines:]]
    after_last = [line for line in metrics[killed_lines:] if int(line["step"]) == STEPS]
    assert all(
        COOKBOOK_0_6 and all(key == "step" or key.startswith(("test/", "tokens/")) for key in line)
        for line in after_last
    ), after_last
    steps = steps[: len(steps) - len(after_last)]
    assert steps[0] == KILL_AT_CHECKPOINT and steps == list(range(KILL_AT_CHECKPOINT, STEPS)), steps


def _assert_checkpoints_kept(engine: LocalEngine, log_path: Path) -> None:
    """Every checkpoint the loop recorded exists on the engine: periodic ones with the cookbook's TTL as
    their expiry, the final one without; of the unnamed sampler snapshots (ephemeral: the SDK's
    save_weights_for_sampler without a name, one per RL step or evaluation), at most the engine's cap
    per training client remain while the loop's session has not finished."""
    records = _checkpoints(log_path)
    assert [r["name"] for r in records][-1] == "final"
    model_ids = {r["state_path"].removeprefix("tinker://").split("/")[0] for r in records}
    rest = engine.rest_client()
    stored = {
        c.tinker_path: c
        for model_id in model_ids
        for c in rest.list_checkpoints(model_id).result().checkpoints
    }
    for record in records:
        for path in (record["state_path"], record["sampler_path"]):
            assert path in stored, (path, sorted(stored))
            expires_at = stored[path].expires_at
            if record["name"] == "final":
                assert expires_at is None
            else:  # the cookbook's periodic checkpoints: ttl_seconds 7 days
                assert expires_at is not None and expires_at.timestamp() > time.time() + 6 * 86400
    named = {path for r in records for path in (r["state_path"], r["sampler_path"])}
    unnamed = [path for path in stored if path not in named]
    assert all("/sampler_weights/" in path for path in unnamed), unnamed
    per_model = [path.removeprefix("tinker://").split("/")[0] for path in unnamed]
    assert all(per_model.count(m) <= UNNAMED_SNAPSHOTS_KEPT_PER_MODEL for m in per_model), unnamed
    _assert_sessions_finish(engine, model_ids, named)


def _assert_sessions_finish(engine: LocalEngine, model_ids: set[str], named: set[str]) -> None:
    """The loop's process has ended: within the session timeout (plus a sweep) its sessions are finished,
    no training client stays loaded and no unnamed sampler snapshot survives; named checkpoints stay."""
    rest = engine.rest_client()
    deadline = time.monotonic() + SESSION_TIMEOUT + 30.0
    while True:
        stored = {c.tinker_path for m in model_ids for c in rest.list_checkpoints(m).result().checkpoints}
        live = engine.stats()["live_models"]
        if (live == 0 and stored == named) or time.monotonic() > deadline:
            break
        time.sleep(1.0)
    assert live == 0, f"{live} training clients still loaded after their sessions fell silent"
    assert stored == named, f"ephemeral snapshots left: {sorted(stored - named)}; missing: {named - stored}"


def test_supervised_loop_trains_evaluates_checkpoints_and_resumes(
    engine: LocalEngine, tmp_path: Path
) -> None:
    log_path = tmp_path / "sft"
    metrics, killed_lines = _killed_then_resumed(engine, "sft", log_path)
    _assert_resumed_from_checkpoint(metrics, killed_lines)
    nll = {int(line["step"]): float(line["train_mean_nll"]) for line in metrics}
    # Resumed weights, not fresh ones: the first resumed step starts well below the initial loss.
    assert nll[KILL_AT_CHECKPOINT] < nll[0] - 0.5, nll
    assert nll[STEPS - 1] < nll[0] - 2.0, nll
    evaluated = {int(line["step"]): float(line["test/nll"]) for line in metrics if "test/nll" in line}
    assert sorted(evaluated) == [0, 2, 4, 6] and evaluated[6] < evaluated[0] - 1.0, evaluated
    _assert_checkpoints_kept(engine, log_path)


def test_rl_loop_trains_evaluates_checkpoints_and_resumes(engine: LocalEngine, tmp_path: Path) -> None:
    log_path = tmp_path / "rl"
    metrics, killed_lines = _killed_then_resumed(engine, "rl", log_path)
    _assert_resumed_from_checkpoint(metrics, killed_lines)
    reward = {
        int(line["step"]): float(line["env/all/reward/total"])
        for line in metrics
        if int(line["step"]) < STEPS
    }
    first, last = (reward[0] + reward[1]) / 2, (reward[STEPS - 2] + reward[STEPS - 1]) / 2
    assert last > first + 0.1, reward
    evaluated = [line for line in metrics if "test/env/all/reward/total" in line]
    expected = [0, 2, 4, 6, STEPS] if COOKBOOK_0_6 else [0, 2, 4, 6]
    assert sorted(int(line["step"]) for line in evaluated) == expected, evaluated
    _assert_checkpoints_kept(engine, log_path)


def test_async_rl_loop_samples_off_policy_and_trains(engine: LocalEngine, tmp_path: Path) -> None:
    """The cookbook's AsyncConfig loop samples from sampling clients of older unnamed snapshots while
    newer ones exist (the engine keeps a snapshot while a client uses it) and trains step after step.
    How many steps it trains depends on timing: once its dataloader is done the cookbook discards the
    groups more than max_steps_off_policy behind instead of requeuing them, and a group requeued just
    before the workers shut down is never sampled again. So only what the loop guarantees is checked:
    consecutive steps from 0, each on groups_per_batch groups at most max_steps_off_policy behind, and
    every trained, requeued or discarded group one the loop sampled (a requeued one sampled at most
    once more)."""
    # Imported here: the runner loads the cookbook's RL loop, which no other test here needs to collect.
    from cookbook_runs import GROUPS_PER_BATCH, TRAIN_GROUP_SAMPLED

    off_policy = 2
    log_path = tmp_path / "rl-async"
    _run(engine, "rl", log_path, extra=("--off-policy", str(off_policy)))
    output = (log_path.parent / "rl-async-rl-resumed.out").read_text()
    assert "were deleted" not in output, output[-3000:]
    trained = [line for line in _metrics(log_path) if "env/all/reward/total" in line]
    steps = [int(line["step"]) for line in trained]
    assert 1 <= len(steps) <= STEPS and steps == list(range(len(steps))), steps
    sampled = output.count(TRAIN_GROUP_SAMPLED)
    requeued = output.count("Samples are too stale, requeuing")
    discarded = output.count("Samples are too stale, discarding (dataloader done)")
    account = {"sampled": sampled, "requeued": requeued, "discarded": discarded, "steps": len(steps)}
    assert GROUPS_PER_BATCH * len(steps) + requeued + discarded <= sampled, account
    assert sampled <= GROUPS_PER_BATCH * STEPS + requeued, account
    # The sampling client is replaced only after a step, while the workers sample on: step 1's groups
    # come from step 0's client at the latest, so some step trains off-policy.
    behind = [int(line["step"]) - int(line["sampling_client/step_min"]) for line in trained]
    assert min(behind) >= 0 and 1 <= max(behind) <= off_policy, behind
    _assert_checkpoints_kept(engine, log_path)


def test_stable_reinforce_trains_in_the_cookbook_s_rl_loop(engine: LocalEngine, tmp_path: Path) -> None:
    """stable_reinforce, cookbook 0.6's default loss: from 0.6 through its own recipes/rl_loop.py (with
    its sampled-provenance spans), before it through the RL loop's `loss_fn`. Every step samples, trains
    (no step skipped, no unknown loss) and logs its reward; the final checkpoint is kept."""
    if COOKBOOK_0_6:
        log_path, reward_key = tmp_path / "rl-loop", "reward/total"
        # Its periodic checkpoints are state only; the final one has both, as the other loops' do.
        _run(engine, "rl-loop", log_path, extra=("--save-every", "0"))
        output = (log_path.parent / "rl-loop-rl-loop-resumed.out").read_text()
    else:
        log_path, reward_key = tmp_path / "rl-stable-reinforce", "env/all/reward/total"
        _run(engine, "rl", log_path, extra=("--loss-fn", "stable_reinforce"))
        output = (log_path.parent / "rl-stable-reinforce-rl-resumed.out").read_text()
    assert "unknown loss_fn" not in output and "skipping training step" not in output, output[-3000:]
    trained = [line for line in _metrics(log_path) if reward_key in line]
    assert [int(line["step"]) for line in trained] == list(range(STEPS)), trained
    assert all(0.0 <= float(line[reward_key]) <= 1.0 for line in trained), trained
    _assert_checkpoints_kept(engine, log_path)


def test_off_policy_distillation_learns_a_teacher_s_top_k(engine: LocalEngine, tmp_path: Path) -> None:
    """distillation/train_off_policy.py: each step asks the teacher for its top-4 next tokens at every
    position (topk_prompt_logprobs) and trains the student by cross_entropy over those [N, 4] soft
    targets. The teacher here learnt the answer format; the student, a fresh LoRA, moves towards it."""
    from cookbook_runs import LORA_RANK, MODEL, AnswerDatasetBuilder

    train, _ = AnswerDatasetBuilder(steps=4)()
    with engine.service_client() as service:
        teacher = service.create_lora_training_client(MODEL, rank=LORA_RANK, seed=0).result()
        for step in range(len(train)):
            teacher.forward_backward(train.get_batch(step), "cross_entropy").result()
            teacher.optim_step(tinker.AdamParams(learning_rate=5e-3)).result()
        teacher_path = teacher.save_weights_for_sampler("teacher").result().path
    log_path = tmp_path / "distill"
    _run(engine, "distill", log_path, extra=("--teacher", teacher_path))
    trained = _metrics(log_path)
    assert [int(line["step"]) for line in trained] == list(range(STEPS)), trained
    loss = [float(line["train/loss:sum"]) for line in trained]
    assert all(value > 0 for value in loss), loss
    assert (loss[-1] + loss[-2]) / 2 < 0.8 * (loss[0] + loss[1]) / 2, loss
    _assert_checkpoints_kept(engine, log_path)


def test_decision_model_scores_with_target_prompt_logprobs_and_trains_on_soft_labels(
    engine: LocalEngine, tmp_path: Path
) -> None:
    """recipes/decisions: sample_decision scores each choice's token at the answer position
    (target_prompt_logprobs, sparse, padded with -1) and softmaxes them; probability_loss trains the
    choice distribution through forward_backward_custom over [N, K] target tokens."""
    from cookbook_runs import DECISION_TARGET

    log_path = tmp_path / "decisions.json"
    _run(engine, "decisions", log_path)
    run = json.loads(log_path.read_text())
    target = list(DECISION_TARGET.values())
    for before, after in zip(run["before"], run["after"], strict=True):
        assert list(before) == list(after) == list(DECISION_TARGET), (before, after)
        assert sum(before.values()) == pytest.approx(1.0, abs=1e-4)
        assert sum(after.values()) == pytest.approx(1.0, abs=1e-4)
        error = [sum((p - t) ** 2 for p, t in zip(d.values(), target, strict=True)) for d in (before, after)]
        assert error[1] < error[0] / 2, (before, after)
    assert run["losses"][-1] < run["losses"][0] / 2, run["losses"]


def test_tinker_sdk_reaches_the_engine_from_the_environment(engine: LocalEngine) -> None:
    """What the loops rely on: SDK clients made with no arguments find the engine and its key."""
    env = engine.sdk_user_env()
    with pytest.MonkeyPatch.context() as patch:
        for name in ("TINKER_BASE_URL", "TINKER_API_KEY"):
            patch.setenv(name, env[name])
        capabilities = tinker.RestClient().get_server_capabilities().result()
    assert "tinkerrpc/tiny-chat" in {m.model_name for m in capabilities.supported_models}
