"""The pool of fixed-size KV blocks: reference counts, a free list in LRU order,
and the prefix-cache map from block hash to block. No tensors here.

Invariants:
- A block with ``ref_cnt > 0`` is in use by that many requests and is never in
  the free list.
- A block with ``ref_cnt == 0`` is in the free list. If it also has a hash it
  still holds valid KV and can be revived by a prefix-cache hit until it is
  handed out again; handing it out evicts its hash.
- The free list is ordered least-recently-freed first, so eviction is LRU.

Given an event list, the pool appends to it every change in what a lookup can find
(`backend_engine.core.kv_event_log`): a hash registered, a hash withdrawn, the cache reset. So the
hashes a listener derives from the events are always the keys of ``_cached``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from backend_engine.core.kv_event_log import BlockEvicted, BlockStored, CacheCleared, KVCacheEvent
from engine_protocol.block_hash import BlockHash


@dataclass
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: BlockHash | None = None


class BlockPool:
    def __init__(
        self,
        num_blocks: int,
        enable_caching: bool = True,
        events: list[KVCacheEvent] | None = None,
    ) -> None:
        """``events``: where to append prefix-cache events (None: report nothing); its owner
        takes them out as it pleases (the pool only appends)."""
        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        self._free: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_evictions = 0
        self._events = events

    @property
    def num_free_blocks(self) -> int:
        """Blocks no request references (cached-but-unused ones included)."""
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        return self._cached.get(block_hash)

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference on cached blocks (a prefix-cache hit)."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def allocate(self, num_blocks: int) -> list[KVBlock] | None:
        """Hand out ``num_blocks`` blocks, evicting cached ones LRU-first; None if short."""
        if num_blocks > len(self._free):
            return None
        allocated = []
        for _ in range(num_blocks):
            block_id, _ = self._free.popitem(last=False)
            block = self.blocks[block_id]
            if block.block_hash is not None:
                self._withdraw(block, block.block_hash)
                self.num_evictions += 1
            block.ref_cnt = 1
            allocated.append(block)
        return allocated

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; unreferenced ones join the free list's tail
        in the order given (so pass a sequence's blocks tail-first to evict them first)."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} freed more often than referenced")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = None

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Register a full, referenced block under its hash (first writer wins)."""
        if not self.enable_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return  # an identical block is already cached; this one stays private
        block.block_hash = block_hash
        self._cached[block_hash] = block
        if self._events is not None:
            self._events.append(BlockStored(block.block_id, block_hash))

    def uncache(self, blocks: Iterable[KVBlock]) -> None:
        """Withdraw blocks from the prefix cache (their KV may never have been written)."""
        for block in blocks:
            if block.block_hash is not None:
                self._withdraw(block, block.block_hash)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (e.g. after new weights)."""
        for block in self._cached.values():
            block.block_hash = None
        self._cached.clear()
        if self._events is not None:
            self._events.append(CacheCleared())

    @property
    def cached_hashes(self) -> frozenset[BlockHash]:
        """Every hash a lookup can find now."""
        return frozenset(self._cached)

    def _withdraw(self, block: KVBlock, block_hash: BlockHash) -> None:
        del self._cached[block_hash]
        block.block_hash = None
        if self._events is not None:
            self._events.append(BlockEvicted(block.block_id, block_hash))
