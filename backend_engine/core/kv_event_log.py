"""What the prefix cache publishes: which block hashes became findable, stopped being
findable, or were all forgotten, numbered so a listener knows when it missed some.

Two layers, no tensors, no I/O:

- the block pool appends one :data:`KVCacheEvent` per change to a list it is given
  (``BlockPool(..., events=[])``): a hash registered (`BlockStored`), a hash withdrawn, when a
  cached free block is handed out again or uncached (`BlockEvicted`), the cache reset
  (`CacheCleared`). A touched (revived) or freed block changes nothing a lookup sees, so
  it reports nothing;
- `KVEventLog` turns batches of them into the lines of ``GET /kv_events`` (the wire format
  below) and keeps what a snapshot needs: the last sequence number and the set of hashes
  the cache holds, always equal to the pool's after the same events.

The wire format (one JSON object per line; hashes are lowercase hex)::

    {"type": "snapshot", "engine_id": "...", "seq": 7, "block_size": 16,
     "extra_key": "...", "blocks": ["...", ...]}        # everything up to and with seq 7
    {"type": "stored", "seq": 8, "blocks": ["...", ...]}
    {"type": "evicted", "seq": 9, "blocks": ["...", ...]}
    {"type": "cleared", "seq": 10}

Consecutive pool events of one kind in a batch become one line; ``seq`` grows by exactly 1 a
line, per log (one log per engine process, named by ``engine_id``). A hash is
``block_pool.hash_block(parent, token_ids, extra_key)``: a client computes a prompt's chain
with that same function, seeded with the snapshot's ``extra_key``.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

WireEvent = dict[str, Any]  # one line of the stream, before JSON encoding


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
        self.hashes: set[bytes] = set()

    def snapshot(self) -> WireEvent:
        """The snapshot line: every hash findable as of ``seq``."""
        return {
            "type": "snapshot",
            "engine_id": self.engine_id,
            "seq": self.seq,
            "block_size": self.block_size,
            "extra_key": self.extra_key.hex(),
            "blocks": sorted(block_hash.hex() for block_hash in self.hashes),
        }

    def record(self, events: Iterable[KVCacheEvent]) -> list[WireEvent]:
        """Apply a batch of pool events; the lines they become, numbered from ``seq + 1``."""
        lines: list[WireEvent] = []
        for event in events:
            if isinstance(event, CacheCleared):
                self.hashes.clear()
                self.seq += 1
                lines.append({"type": "cleared", "seq": self.seq})
                continue
            if isinstance(event, BlockStored):
                kind = "stored"
                self.hashes.add(event.block_hash)
            else:
                kind = "evicted"
                self.hashes.discard(event.block_hash)
            if lines and lines[-1]["type"] == kind:
                lines[-1]["blocks"].append(event.block_hash.hex())
            else:
                self.seq += 1
                lines.append({"type": kind, "seq": self.seq, "blocks": [event.block_hash.hex()]})
        return lines
