"""The scheduler's one window onto KV memory.

The scheduler asks two questions: "which of this request's leading blocks are
already cached?" (``get_computed_blocks``) and "give this request room for N
more tokens" (``allocate_slots``), which answers with an ``Allocation`` or
``None`` meaning "no room: preempt someone". Blocks are allocated only as tokens
need them; nothing is reserved for a request's maximum length.

A choice of an ``n`` > 1 request is forked off its leader once the leader's prompt is computed
(``fork``): it takes references on the leader's full blocks and gets a private copy of the
partial last one, which the runner makes (``BlockCopy``) before the next forward pass.

The prefix-cache metrics count admissions: ``allocate_slots`` with a cached prefix adds the
request's tokens to the queries and the prefix's tokens to the hits, once it succeeds. A
lookup alone counts nothing, so a request that waits several steps is counted once.
"""

from __future__ import annotations

from dataclasses import dataclass

from backend_engine.core.block_pool import BlockPool, KVBlock
from backend_engine.core.kv_event_log import KVCacheEvent
from backend_engine.core.request import Request
from engine_protocol.block_hash import hash_block


@dataclass(frozen=True)
class Allocation:
    new_block_ids: tuple[int, ...]


@dataclass(frozen=True)
class BlockCopy:
    """Copy one KV block's contents (every layer, K and V) into another, before the next
    forward pass: block ids only, the runner owns the tensors."""

    src_block_id: int
    dst_block_id: int


@dataclass(frozen=True)
class CachedPrefix:
    blocks: tuple[KVBlock, ...]
    num_tokens: int
    block_hashes: tuple[bytes, ...] = ()  # what each block held when it was found


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_caching: bool = True,
        extra_key: bytes = b"",
        kv_events: list[KVCacheEvent] | None = None,
    ) -> None:
        """``kv_events``: where the block pool appends its prefix-cache events (None: none)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.extra_key = extra_key
        self.pool = BlockPool(num_blocks, enable_caching, kv_events)
        self._blocks: dict[str, list[KVBlock]] = {}
        self._num_hashed_blocks: dict[str, int] = {}  # leading blocks already offered to the cache
        self.prefix_cache_queries = 0  # tokens looked up
        self.prefix_cache_hits = 0  # tokens found

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_used_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def block_table(self, request_id: str) -> list[int]:
        return [block.block_id for block in self._blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> CachedPrefix:
        """The longest run of the request's leading full blocks already in the cache.

        At least the last token is always left to compute, since its logits are
        needed to sample the next one. Takes no references, so the blocks may be
        evicted before the request is admitted: check with :meth:`is_still_cached`.
        Nothing for a request that still owes prompt logprobs: they need every logit.
        """
        if not self.enable_caching or request.owes_prompt_logprobs:
            return CachedPrefix((), 0)
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hits.append(block)
        num_hit_tokens = len(hits) * self.block_size
        return CachedPrefix(tuple(hits), num_hit_tokens, tuple(request.block_hashes[: len(hits)]))

    @staticmethod
    def is_still_cached(prefix: CachedPrefix) -> bool:
        """Whether every block of an earlier lookup still holds the KV it was found with
        (handing a block out evicts its hash; a block re-cached under the same hash holds
        the same tokens)."""
        return all(
            block.block_hash == block_hash
            for block, block_hash in zip(prefix.blocks, prefix.block_hashes, strict=True)
        )

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        cached_prefix: CachedPrefix | None = None,
        num_reserved_blocks: int = 0,
        num_lookahead_tokens: int = 0,
    ) -> Allocation | None:
        """Make room for ``num_new_tokens`` more tokens after those already computed
        (plus a cached prefix, for a request being admitted: the prefix-cache metrics
        count it on success), and for ``num_lookahead_tokens`` after them: draft tokens
        (speculative decoding), scored in the same step but not yet the request's.

        ``num_reserved_blocks`` must stay free afterwards (the admission watermark).
        On success, full blocks covered by the new tokens are registered in the prefix
        cache: their KV is written in the same forward pass that reads them. Lookahead
        tokens never register a block: a block holding an unverified token is never
        offered to the cache (:meth:`trim` frees what the rejected ones took).
        """
        blocks = self._blocks.setdefault(request.request_id, [])
        hits = cached_prefix.blocks if cached_prefix is not None else ()
        num_computed = request.num_computed_tokens + (
            cached_prefix.num_tokens if cached_prefix is not None else 0
        )
        num_total = num_computed + num_new_tokens
        num_needed = self.blocks_needed(num_total + num_lookahead_tokens) - len(blocks) - len(hits)
        # Cached blocks with no references sit in the free list: reviving them
        # uses up free capacity just like a fresh allocation does.
        num_revived = sum(1 for block in hits if block.ref_cnt == 0)
        if num_needed + num_revived + num_reserved_blocks > self.pool.num_free_blocks:
            if not blocks:
                del self._blocks[request.request_id]
            return None
        self.pool.touch(hits)
        blocks.extend(hits)
        if cached_prefix is not None and self.enable_caching:
            self.prefix_cache_queries += request.num_tokens
            self.prefix_cache_hits += cached_prefix.num_tokens
        new_blocks = self.pool.allocate(max(num_needed, 0)) or []
        blocks.extend(new_blocks)
        if self.enable_caching:
            self._cache_full_blocks(request, blocks, num_total)
        return Allocation(tuple(block.block_id for block in new_blocks))

    def fork(
        self, parent: Request, child: Request, num_reserved_blocks: int = 0
    ) -> tuple[BlockCopy, ...] | None:
        """Give ``child`` the KV of ``parent``'s computed tokens: a reference on each full
        block, and a fresh block for the partial last one, with the copy that fills it
        (nothing to copy when the tokens end on a block boundary). None: no free block for
        the copy (``num_reserved_blocks`` must stay free, as for an admission).

        The full blocks are shared read-only: a sequence only ever writes past its computed
        tokens, which is in the partial block (now private to each) or in a new one.
        """
        if child.request_id in self._blocks:
            raise ValueError(f"request {child.request_id!r} already holds KV blocks")
        parent_blocks = self._blocks.get(parent.request_id, [])
        num_full, num_partial = divmod(parent.num_computed_tokens, self.block_size)
        if len(parent_blocks) < num_full + (num_partial > 0):
            raise ValueError(f"request {parent.request_id!r} holds too few blocks to fork")
        if num_partial and 1 + num_reserved_blocks > self.pool.num_free_blocks:
            return None
        shared = parent_blocks[:num_full]
        self.pool.touch(shared)
        blocks = list(shared)
        copies: tuple[BlockCopy, ...] = ()
        if num_partial:
            [fresh] = self.pool.allocate(1) or []
            blocks.append(fresh)
            copies = (BlockCopy(parent_blocks[num_full].block_id, fresh.block_id),)
        self._blocks[child.request_id] = blocks
        # The same prompt, so the same hash chain; the shared blocks are already cached.
        child.block_hashes = parent.block_hashes[:num_full]
        self._num_hashed_blocks[child.request_id] = min(
            num_full, self._num_hashed_blocks.get(parent.request_id, 0)
        )
        return copies

    def cache_blocks(self, request: Request, num_tokens: int) -> None:
        """Offer the request's blocks full within its first ``num_tokens`` tokens (their KV
        computed, the tokens its own) to the prefix cache: speculative decoding's kept drafts,
        whose blocks no later allocation of the request may offer."""
        blocks = self._blocks.get(request.request_id)
        if self.enable_caching and blocks:
            num_tokens = min(num_tokens, len(blocks) * self.block_size, request.num_tokens)
            self._cache_full_blocks(request, blocks, num_tokens)

    def trim(self, request: Request, num_tokens: int) -> None:
        """Free the blocks past the first ``num_tokens`` tokens (tail first): those taken for
        draft tokens the target rejected. None of them is in the prefix cache (lookahead
        registers nothing), so they go back to the free list as they are."""
        blocks = self._blocks.get(request.request_id)
        num_kept = self.blocks_needed(num_tokens)
        if not blocks or len(blocks) <= num_kept:
            return
        trimmed = blocks[num_kept:]
        del blocks[num_kept:]
        self.pool.free(reversed(trimmed))

    def free(self, request: Request, *, num_written_tokens: int | None = None) -> None:
        """Release a request's blocks, tail first, so its prefix outlives its suffix in the LRU.

        ``num_written_tokens``: for a request that failed mid-step, the leading tokens whose
        KV is known to be written (its computed tokens). Blocks registered in the prefix
        cache past them leave it, so no later request reads KV the failed step never wrote.
        """
        blocks = self._blocks.pop(request.request_id, None)
        self._num_hashed_blocks.pop(request.request_id, None)
        if not blocks:
            return
        if num_written_tokens is not None:
            self.pool.uncache(blocks[num_written_tokens // self.block_size :])
        self.pool.free(reversed(blocks))

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        hashes = request.block_hashes
        tokens = request.all_token_ids
        size = self.block_size
        for index in range(len(hashes), num_tokens // size):
            parent = hashes[-1] if hashes else None
            hashes.append(
                hash_block(parent, tokens[index * size : (index + 1) * size], self.extra_key)
            )

    def _cache_full_blocks(self, request: Request, blocks: list[KVBlock], num_tokens: int) -> None:
        num_full = num_tokens // self.block_size
        start = self._num_hashed_blocks.get(request.request_id, 0)
        if num_full <= start:
            return
        self._update_hashes(request, num_tokens)
        for index in range(start, num_full):
            self.pool.cache(blocks[index], request.block_hashes[index])
        self._num_hashed_blocks[request.request_id] = num_full
