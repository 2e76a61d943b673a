"""What the prefix cache publishes: which block hashes became findable, stopped being
findable, or were all forgotten, numbered so a listener knows when it missed some.

Two layers, no tensors, no I/O:

- the block pool appends one :data:`KVCacheEvent` per change to a list it is given
  (``BlockPool(..., events=[])``): a hash registered (`BlockStored`), a hash withdrawn, when a
  cached free block is handed out again or uncached (`BlockEvicted`), the cache reset
  (`CacheCleared`). A touched (revived) or freed block changes nothing a lookup sees, so
  it reports nothing;
- `KVEventLog` turns batches of them into the typed lines of ``GET /kv_events``
  (`engine_protocol.kv_events`, which documents the wire format) and keeps what a snapshot
  needs: the last sequence number and the set of hashes the cache holds, always equal to the
  pool's after the same events. Consecutive pool events of one kind in a batch become one
  line; ``seq`` grows by exactly 1 a line, per log (one log per engine process, named by
  ``engine_id``).
"""

from __future__ import annotations

import itertools
import uuid
from collections.abc import Iterable
from dataclasses import dataclass

from engine_protocol.block_hash import BlockHash
from engine_protocol.kv_events import ChangeLine, ClearedLine, EvictedLine, SnapshotLine, StoredLine


@dataclass(frozen=True)
class BlockStored:
    """``block_hash`` became findable in the prefix cache, held by block ``block_id``."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class BlockEvicted:
    """``block_hash`` is no longer findable (block ``block_id`` was handed out again or
    uncached)."""

    block_id: int
    block_hash: bytes


@dataclass(frozen=True)
class CacheCleared:
    """Every hash was forgotten at once."""


KVCacheEvent = BlockStored | BlockEvicted | CacheCleared


class KVEventLog:
    """Sequence numbers and the findable hashes of one engine's prefix cache.

    Not thread-safe: one thread (the server's event loop) records and takes snapshots, so a
    snapshot and the lines recorded after it never overlap nor leave a gap.
    """

    def __init__(self, block_size: int, extra_key: bytes, engine_id: str | None = None) -> None:
        self.engine_id = engine_id or uuid.uuid4().hex
        self.block_size = block_size
        self.extra_key = extra_key
        self.seq = 0  # of the last line recorded
        self.hashes: set[BlockHash] = set()

    def snapshot(self) -> SnapshotLine:
        """The snapshot line: every hash findable as of ``seq``."""
        return SnapshotLine(
            engine_id=self.engine_id,
            seq=self.seq,
            block_size=self.block_size,
            extra_key=self.extra_key,
            blocks=tuple(sorted(self.hashes)),  # bytes sort as their hex does
        )

    def record(self, events: Iterable[KVCacheEvent]) -> list[ChangeLine]:
        """Apply a batch of pool events; the lines they become, numbered from ``seq + 1``."""
        lines: list[ChangeLine] = []
        for kind, run in itertools.groupby(events, key=type):
            if kind is CacheCleared:
                for _ in run:
                    self.hashes.clear()
                    self.seq += 1
                    lines.append(ClearedLine(self.seq))
                continue
            hashes = tuple(e.block_hash for e in run if not isinstance(e, CacheCleared))
            self.seq += 1
            if kind is BlockStored:
                self.hashes.update(hashes)
                lines.append(StoredLine(self.seq, hashes))
            else:
                self.hashes.difference_update(hashes)
                lines.append(EvictedLine(self.seq, hashes))
        return lines
