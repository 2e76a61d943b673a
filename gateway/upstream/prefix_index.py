"""What each engine replica's prefix cache holds, rebuilt from its ``GET /kv_events`` stream.

A `ReplicaCache` applies the stream's lines, decoded once by the client
(`engine_protocol.kv_events`, which documents the format; docs/architecture.md, "Replica
choice"):

    snapshot  every block hash the cache holds, the engine's id, seq, block size, extra key
    stored    hashes that became findable          seq + 1
    evicted   hashes no longer findable            seq + 1
    cleared   the whole cache reset                seq + 1
    load      waiting/running requests, KV blocks  (no seq)
    ping      nothing

A change whose ``seq`` is not the next one (a gap: lines were lost) or a change before the
snapshot raises `StreamOutOfSync`: the replica's state is then unknown until a new
connection brings a new snapshot (`gateway.upstream.kv_event_client`). A snapshot replaces
everything, whichever engine process (``engine_id``) it comes from.

`block_chain` hashes a prompt's token ids with the engine's own `hash_block` (imported, never
copied) into the chain its prefix cache keys blocks by, so `ReplicaCache.cached_blocks` can
count how many leading blocks of a request a replica would find.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterator, Sequence

from engine_protocol.block_hash import BlockHash, hash_block
from engine_protocol.kv_events import (
    ChangeLine,
    ClearedLine,
    KvEventLine,
    LoadLine,
    PingLine,
    SnapshotLine,
    StoredLine,
)


class StreamOutOfSync(Exception):
    """The stream lost lines or broke its contract: resubscribe for a fresh snapshot."""


# How far back a replica's recent traffic reaches: a decayed count, e^-1 per this many s.
RECENT_REQUESTS_WINDOW_S = 30.0


class RecentRequests:
    """Requests an engine queued lately: its ``num_requests_total`` counter's increments, each
    decaying by e^-1 every ``RECENT_REQUESTS_WINDOW_S``. Every gateway reads the same counter
    from the same stream, so every gateway reckons about the same figure."""

    def __init__(self, window_s: float = RECENT_REQUESTS_WINDOW_S) -> None:
        self._window_s = window_s
        self._count = 0.0
        self._at = 0.0
        self._total: int | None = None

    def count_up_to(self, total: int, now: float) -> None:
        """The engine's counter reads ``total`` now (it restarts from 0 with the engine)."""
        added = total - self._total if self._total is not None and total >= self._total else 0
        self._count = self.at(now) + added
        self._at, self._total = now, total

    def at(self, now: float) -> float:
        if self._count == 0.0:
            return 0.0
        return self._count * math.exp(-max(0.0, now - self._at) / self._window_s)


class ReplicaCache:
    """One replica's prefix cache as its event stream describes it.

    ``is_known`` is true from a snapshot until `forget` (the stream ended or went out of
    sync). ``num_unreported`` counts requests this gateway sent the replica since its last
    load line (`note_sent`); a load line resets it, since the engine's counts include them.
    """

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self.recent = RecentRequests()
        self.blocks: set[BlockHash] = set()
        self.engine_id: str | None = None
        self.seq = 0
        self.block_size = 0
        self.extra_key = b""
        self.load: LoadLine | None = None  # the last load line
        self.num_unreported = 0
        self.is_known = False

    def forget(self) -> None:
        """The stream is gone: nothing is known until the next snapshot."""
        self.blocks = set()
        self.load = None
        self.is_known = False

    def note_sent(self) -> None:
        self.num_unreported += 1

    def apply(self, line: KvEventLine) -> None:
        """Apply one line of the stream; `StreamOutOfSync` if it cannot be applied."""
        if isinstance(line, LoadLine):
            self.load = line
            self.num_unreported = 0
            if line.num_requests_total is not None:
                self.recent.count_up_to(line.num_requests_total, self._clock())
        elif isinstance(line, SnapshotLine):
            self.blocks = set(line.blocks)
            self.engine_id = line.engine_id
            self.seq = line.seq
            self.block_size = line.block_size
            self.extra_key = line.extra_key
            self.is_known = True
        elif not isinstance(line, PingLine):
            self._change(line)

    def _change(self, line: ChangeLine) -> None:
        if not self.is_known:
            raise StreamOutOfSync(f"a {type(line).__name__} before the snapshot")
        if line.seq != self.seq + 1:
            raise StreamOutOfSync(f"seq {line.seq} after {self.seq}: events were lost")
        if isinstance(line, StoredLine):
            self.blocks.update(line.blocks)
        elif isinstance(line, ClearedLine):
            self.blocks.clear()
        else:
            self.blocks.difference_update(line.blocks)
        self.seq = line.seq

    def cached_blocks(self, chain: Sequence[BlockHash]) -> int:
        """How many leading blocks of ``chain`` the replica holds (its prefix-cache hit
        stops at the first block it lacks, so this does too)."""
        if not self.is_known:
            return 0
        num = 0
        for block_hash in chain:
            if block_hash not in self.blocks:
                break
            num += 1
        return num


class PrefixIndex:
    """Every replica's `ReplicaCache`, by replica base URL."""

    def __init__(self) -> None:
        self._caches: dict[str, ReplicaCache] = {}

    def replica(self, name: str) -> ReplicaCache:
        cache = self._caches.get(name)
        if cache is None:
            cache = self._caches[name] = ReplicaCache()
        return cache

    def remove(self, name: str) -> None:
        self._caches.pop(name, None)

    def __iter__(self) -> Iterator[str]:
        return iter(self._caches)


def block_chain(token_ids: Sequence[int], block_size: int, extra_key: bytes) -> list[BlockHash]:
    """The chain hashes of the prompt's full blocks, as the engine's KV cache manager keys
    them (``KVCacheManager._update_hashes``); a partial last block has none."""
    chain: list[BlockHash] = []
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        chain.append(parent)
    return chain


def cached_prefixes(
    token_ids: Sequence[int], block_size: int, extra_key: bytes, caches: Sequence[ReplicaCache]
) -> tuple[list[int], BlockHash | None]:
    """Each cache's cached prefix of the prompt's chain, in blocks, and the hash of the chain's
    first block no cache holds (its last block where some cache holds all; None for a prompt
    shorter than a block): the prompt's own part, past what it shares with cached prompts,
    which names it for rendezvous ties. The chain is hashed only as far as some cache holds
    it, plus one block: a prompt nobody holds costs one hash, not one per block."""
    num_cached = [0] * len(caches)
    holding = [i for i, cache in enumerate(caches) if cache.is_known]
    parent: BlockHash | None = None
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, token_ids[start : start + block_size], extra_key)
        holding = [i for i in holding if parent in caches[i].blocks]
        if not holding:
            break
        for i in holding:
            num_cached[i] += 1
    return num_cached, parent
