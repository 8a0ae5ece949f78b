"""The sample cache: what the Sample RPC drew (prompt and completion tokens, the sampler's logprobs, the
policy version) kept a while under an unguessable key, so a trajectory that names the key trains on the
sampler's own logprobs instead of being scored again.

A key is `<nonce>.<mac>`: a random nonce and an HMAC-SHA256, under a secret made per server process, over
(model, policy version, a hash of the prompt tokens, a hash of the completion tokens, nonce). A key is
trusted only when its MAC verifies against the entry's contents AND the turn presents the same model,
version and tokens; a forged, tampered, mismatched, expired or evicted key finds nothing, and the turn is
scored. Bounded per server by entries and by bytes (least recently used first out) and by age.

What a restore or DeleteModel discards is gone here too: `discard` drops the keys of the versions it
discarded (a version number trained again names other weights), and a sample whose version was discarded
while it was drawn (its sampler weights are no longer the version's) is not kept."""

from __future__ import annotations

import hashlib
import hmac
import secrets
import struct
import time
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tinkerrpc.contract.limits import MAX_CACHED_SAMPLES, MAX_SAMPLE_CACHE_BYTES, MAX_SAMPLE_KEY_AGE_SECONDS

# What one entry costs besides its tokens and logprobs (key, tuples, dict slot), as counted for the bound.
_ENTRY_OVERHEAD_BYTES = 256
# Bytes per cached token id or logprob, as counted for the bound.
_BYTES_PER_VALUE = 8


def _tokens_digest(tokens: Sequence[int]) -> bytes:
    # Each id as 4 little-endian signed bytes, packed in one call (a per-token to_bytes took 2/3 of a lookup).
    return hashlib.sha256(struct.pack(f"<{len(tokens)}i", *tokens)).digest()


@dataclass(frozen=True)
class CachedSample:
    model: str
    policy_version: int
    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    expires_at: float

    @property
    def size_bytes(self) -> int:
        values = len(self.prompt_token_ids) + len(self.completion_token_ids) + len(self.logprobs)
        return _ENTRY_OVERHEAD_BYTES + _BYTES_PER_VALUE * values


# The sampler weights a model's version has now (Store.sampler_path): None once discarded.
SamplerOf = Callable[[str, int], str | None]


class SampleCache:
    """Bounded, expiring map from sample keys to what was sampled. `sampler_of` tells whether a version's
    sampler weights are still those a sample was drawn from; `clock` (monotonic seconds) is for tests."""

    def __init__(
        self,
        sampler_of: SamplerOf,
        ttl_seconds: float = MAX_SAMPLE_KEY_AGE_SECONDS,
        max_entries: int = MAX_CACHED_SAMPLES,
        max_bytes: int = MAX_SAMPLE_CACHE_BYTES,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if not ttl_seconds > 0:
            raise ValueError(f"ttl_seconds must be > 0, got {ttl_seconds}")
        if max_entries < 1:
            raise ValueError(f"max_entries must be >= 1, got {max_entries}")
        if max_bytes < 1:
            raise ValueError(f"max_bytes must be >= 1, got {max_bytes}")
        self._sampler_of = sampler_of
        self._ttl = ttl_seconds
        self._max_entries = max_entries
        self._max_bytes = max_bytes
        self._clock = clock
        self._secret = secrets.token_bytes(32)
        self._entries: OrderedDict[str, CachedSample] = OrderedDict()
        self._bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def size_bytes(self) -> int:
        return self._bytes

    def _mac(
        self, model: str, policy_version: int, prompt: Sequence[int], completion: Sequence[int], nonce: str
    ) -> str:
        message = b"\x00".join(
            (
                model.encode(),
                str(policy_version).encode(),
                _tokens_digest(prompt),
                _tokens_digest(completion),
                nonce.encode(),
            )
        )
        return hmac.new(self._secret, message, hashlib.sha256).hexdigest()

    def put(
        self,
        model: str,
        policy_version: int,
        prompt_token_ids: Sequence[int],
        completion_token_ids: Sequence[int],
        logprobs: Sequence[float],
        *,
        sampled_from: str,
    ) -> str:
        """Keeps one sequence sampled from the sampler weights `sampled_from` and returns its key (evicting
        the oldest entries over the bounds). When the version no longer has those weights (a restore or
        DeleteModel discarded it during the call) nothing is kept: a turn naming the key is scored."""
        if len(logprobs) != len(completion_token_ids):
            raise ValueError(f"{len(logprobs)} logprobs for {len(completion_token_ids)} completion tokens")
        nonce = secrets.token_urlsafe(16)
        key = f"{nonce}.{self._mac(model, policy_version, prompt_token_ids, completion_token_ids, nonce)}"
        if self._sampler_of(model, policy_version) != sampled_from:
            return key
        entry = CachedSample(
            model,
            policy_version,
            tuple(prompt_token_ids),
            tuple(completion_token_ids),
            tuple(logprobs),
            self._clock() + self._ttl,
        )
        self._drop_expired()
        if entry.size_bytes > self._max_bytes:
            return key  # too large to keep: a turn naming it is scored
        self._entries[key] = entry
        self._bytes += entry.size_bytes
        while len(self._entries) > self._max_entries or self._bytes > self._max_bytes:
            self._remove(next(iter(self._entries)))
        return key

    def logprobs(
        self,
        key: str,
        model: str,
        policy_version: int,
        prompt_token_ids: Sequence[int],
        completion_token_ids: Sequence[int],
    ) -> tuple[float, ...] | None:
        """The sampler's logprobs kept under `key` when the key is genuine, unexpired and names exactly
        this model, version, prompt and completion; else None (the caller scores the turn)."""
        entry = self._entries.get(key)
        if entry is None:
            return None
        if entry.expires_at <= self._clock():
            self._remove(key)
            return None
        nonce, _, mac = key.partition(".")
        expected = self._mac(model, policy_version, prompt_token_ids, completion_token_ids, nonce)
        if not hmac.compare_digest(mac, expected):
            return None
        if (entry.model, entry.policy_version, entry.prompt_token_ids, entry.completion_token_ids) != (
            model,
            policy_version,
            tuple(prompt_token_ids),
            tuple(completion_token_ids),
        ):
            return None
        self._entries.move_to_end(key)
        return entry.logprobs

    def discard(self, model: str, from_version: int = 0) -> None:
        """Forget the model's keys of versions >= `from_version` (a restore to it, or DeleteModel: 0)."""
        for key in [
            k for k, e in self._entries.items() if e.model == model and e.policy_version >= from_version
        ]:
            self._remove(key)

    def _drop_expired(self) -> None:
        now = self._clock()
        # Entries are kept in use order, not expiry order: only the least recently used run of expired
        # entries goes here; any other expired entry goes on lookup or falls out by the bounds.
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.expires_at > now:
                return
            self._remove(key)

    def _remove(self, key: str) -> None:
        self._bytes -= self._entries.pop(key).size_bytes
