"""The sampler-snapshot ledger: the engine's sampling sessions, the sample requests in flight, and the
unnamed sampler snapshots they keep alive.

An unnamed `save_weights_for_sampler` snapshot is ephemeral: once a newer unnamed snapshot of the same
training client supersedes it (or the client is unloaded) it may go as soon as no sampling session and
no sample request in flight refers to it and the snapshot grace has passed since the last one did, so
an off-policy rollout still sampling from an older client finishes; at most
UNNAMED_SNAPSHOTS_KEPT_PER_MODEL stay per training client (past it the oldest go, unused ones first).
The ledger decides which snapshots go; the engine deletes them from storage.

Inflight sampling sessions (`save_weights_for_sampler(kind="inflight")`) follow their training client's
weights: each inflight save publishes its snapshot as the client's inflight target, numbered from 1 (its
weights version), and moves every inflight sampling session of that client onto it. A sample request
runs, from its first token to its last, on the target its session had when the request arrived: the
newest published by then, never older than the one its session was made with.
"""

from __future__ import annotations

import threading
import time
from collections import Counter, OrderedDict
from dataclasses import dataclass, replace
from pathlib import Path

# Unnamed sampler snapshots kept per training client, its newest included: disk stays bounded however
# many sampling clients an async RL loop holds (each is one adapter's size).
UNNAMED_SNAPSHOTS_KEPT_PER_MODEL = 8


@dataclass(frozen=True)
class Sampler:
    """What a sample request samples from: a base model, with a checkpoint's adapter or without."""

    sampler_id: str  # "" for a one-off sampler of a request without a sampling session
    base_model: str
    model_path: str | None
    weights_dir: Path | None
    # Inflight sessions: the training client whose inflight target they follow, and that target's version.
    inflight_of: str | None = None
    weights_version: int | None = None


@dataclass
class UnnamedSnapshot:
    model_id: str
    checkpoint_id: str
    tinker_path: str
    last_used: float  # time.monotonic() when a sampling session or request last let go of it
    current: bool = True  # its training client's newest, while that client is live


def _model_of(model_path: str) -> str:
    return model_path.removeprefix("tinker://").split("/", 1)[0]


class SamplerLedger:
    """Thread-safe: routes open sampling sessions and sample requests, the compute thread saves and
    supersedes snapshots, the sweep finds the unused ones."""

    def __init__(self, grace: float) -> None:
        """`grace`: seconds a superseded snapshot stays after the last user let go of it."""
        self.grace = grace
        self._lock = threading.Lock()
        self._samplers: dict[str, Sampler] = {}
        # model_id -> tinker path -> its unnamed sampler snapshots on disk, oldest first.
        self._snapshots: dict[str, OrderedDict[str, UnnamedSnapshot]] = {}
        self._samples_in_flight: Counter[str] = Counter()  # model path -> sample requests not answered
        self._inflight_versions: Counter[str] = Counter()  # model_id -> its inflight saves so far

    # ---- sampling sessions and requests ----

    def add_sampler(self, sampler: Sampler) -> None:
        with self._lock:
            self._samplers[sampler.sampler_id] = sampler

    def publish_inflight(self, model_id: str, target: Sampler) -> Sampler:
        """`target` (a new snapshot of `model_id`) becomes its inflight target, with the next weights
        version; every inflight sampling session of `model_id` moves onto it. The session to add for it."""
        with self._lock:
            self._inflight_versions[model_id] += 1
            published = replace(
                target, inflight_of=model_id, weights_version=self._inflight_versions[model_id]
            )
            moved = [s for s in self._samplers.values() if s.inflight_of == model_id]
            for session in moved:
                self._samplers[session.sampler_id] = replace(published, sampler_id=session.sampler_id)
        for session in moved:
            if session.model_path is not None:
                self.let_go(session.model_path)
        return published

    def sampler(self, sampler_id: str) -> Sampler | None:
        with self._lock:
            return self._samplers.get(sampler_id)

    def sampler_ids(self, prefix: str) -> list[str]:
        """The ids of the sampling sessions held whose ids start with `prefix`."""
        with self._lock:
            return sorted(s for s in self._samplers if s.startswith(prefix))

    def forget_samplers(self, prefix: str) -> None:
        """Forget the sampling sessions whose ids start with `prefix`; their snapshots' grace starts."""
        with self._lock:
            gone = [self._samplers.pop(s) for s in [s for s in self._samplers if s.startswith(prefix)]]
        for sampler in gone:
            if sampler.model_path is not None:
                self.let_go(sampler.model_path)

    def sample_started(self, model_path: str) -> None:
        """A sample request of `model_path` is queued: its snapshot stays until it is answered."""
        with self._lock:
            self._samples_in_flight[model_path] += 1

    def sample_answered(self, model_path: str) -> None:
        with self._lock:
            self._samples_in_flight[model_path] -= 1
            if self._samples_in_flight[model_path] <= 0:
                del self._samples_in_flight[model_path]
        self.let_go(model_path)

    def let_go(self, model_path: str) -> None:
        """A sampling session or request of `model_path` ended: its grace starts now."""
        now = time.monotonic()
        with self._lock:
            kept = self._snapshots.get(_model_of(model_path))
            snapshot = kept.get(model_path) if kept is not None else None
            if snapshot is not None:
                snapshot.last_used = now

    # ---- unnamed snapshots ----

    def add_snapshot(self, model_id: str, checkpoint_id: str, tinker_path: str) -> list[UnnamedSnapshot]:
        """A training client's new unnamed snapshot, which supersedes its previous ones; the snapshots
        that must go now, past the cap per training client."""
        self.supersede(model_id)
        with self._lock:
            kept = self._snapshots.setdefault(model_id, OrderedDict())
            kept[tinker_path] = UnnamedSnapshot(model_id, checkpoint_id, tinker_path, time.monotonic())
            return self._over_cap(kept)

    def supersede(self, model_id: str) -> None:
        """The training client's snapshots are no longer its newest (a newer one, or it was unloaded)."""
        now = time.monotonic()
        with self._lock:
            for snapshot in self._snapshots.get(model_id, OrderedDict()).values():
                if snapshot.current:
                    snapshot.current, snapshot.last_used = False, now

    def unused(self, now: float) -> list[UnnamedSnapshot]:
        """Removes and returns the superseded snapshots nothing has used for the grace before `now`."""
        doomed = []
        with self._lock:
            users = self._users()
            for model_id, kept in list(self._snapshots.items()):
                for snapshot in list(kept.values()):
                    if snapshot.current:
                        continue
                    if users[snapshot.tinker_path]:
                        snapshot.last_used = now
                    elif now - snapshot.last_used >= self.grace:
                        doomed.append(kept.pop(snapshot.tinker_path))
                if not kept:
                    del self._snapshots[model_id]
        return doomed

    def _users(self) -> Counter[str]:
        """Model path -> sampling sessions and sample requests in flight that refer to it (under the
        lock)."""
        users = Counter(s.model_path for s in self._samplers.values() if s.model_path is not None)
        users.update(self._samples_in_flight)
        return users

    def _over_cap(self, kept: OrderedDict[str, UnnamedSnapshot]) -> list[UnnamedSnapshot]:
        """Removes and returns the snapshots past the cap: the oldest superseded ones, unused first
        (under the lock)."""
        excess = len(kept) - UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
        if excess <= 0:
            return []
        users = self._users()
        superseded = [s for s in kept.values() if not s.current]
        doomed = sorted(superseded, key=lambda s: users[s.tinker_path] > 0)[:excess]
        for snapshot in doomed:
            del kept[snapshot.tinker_path]
        return doomed
