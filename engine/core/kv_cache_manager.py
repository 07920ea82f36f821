"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import ROOT_HASH, BlockPool, KVCacheBlock, hash_blocks
from .request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    """The narrow boundary between scheduler and KV memory: find a cached prefix,
    allocate slots for new tokens (or say None), free a request. A request's block table
    is its `kv` state (`kv.block_ids`, appended as blocks are allocated), which only this
    class writes."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = request.kv.block_hashes
        start, end = len(hashes) * bs, num_tokens // bs * bs
        if end > start:
            hashes.extend(hash_blocks(hashes[-1] if hashes else ROOT_HASH, request.token_at(start, end), bs))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. At least one token is always left to
        compute, because the last position's logits are needed to sample."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.kv.block_hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.append(block)
        return hit, len(hit) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admitted request's lookup (failed admission attempts don't count)."""
        if self.enable_prefix_caching:
            self.prefix_stats.queries += num_tokens
            self.prefix_stats.hits += num_hit_tokens

    def allocate_slots(
        self,
        request: Request,
        num_new_tokens: int,
        computed_blocks: list[KVCacheBlock] | None = None,
        *,
        num_computed: int | None = None,
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus any
        prefix-hit blocks, which must not be held by the request yet). None: no room.
        `num_computed` stands for the request's count of computed tokens: the fleet's
        fast-forward allocates a run's slots as each step of it would have."""
        bs = self.block_size
        held = request.kv.block_ids
        if num_computed is None:
            num_computed = request.num_computed_tokens
        needed = self.blocks_needed(request, num_new_tokens, computed_blocks, num_computed=num_computed)
        if needed is None:
            return None
        total = num_computed + num_new_tokens
        if computed_blocks:
            total += len(computed_blocks) * bs
            self.pool.touch(computed_blocks)
            held.extend(b.block_id for b in computed_blocks)
        new = []
        if needed > 0:  # most decode steps fit in the last block and skip this
            new = self.pool.take(needed)
            held.extend([b.block_id for b in new])
        # Draft tokens (past num_tokens) are not the request's: their blocks stay unhashed.
        cacheable = min(total, request.num_tokens)
        if self.enable_prefix_caching and cacheable // bs > request.kv.num_hashed_blocks:
            self._cache_full_blocks(request, cacheable)
        return new

    def blocks_needed(self, request: Request, num_new_tokens: int,
                      computed_blocks: list[KVCacheBlock] | None = None, *,
                      num_computed: int | None = None) -> int | None:
        """The new blocks allocate_slots would take (0 or more), or None: no room. Changes nothing."""
        bs = self.block_size
        total = (request.num_computed_tokens if num_computed is None else num_computed) + num_new_tokens
        if computed_blocks:
            total += len(computed_blocks) * bs
            needed = -(-total // bs) - len(request.kv.block_ids) - len(computed_blocks)
            # Reviving cached blocks takes them out of the free queue too.
            evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
            return None if needed > self.pool.num_free_blocks - evictable_hits else needed
        needed = -(-total // bs) - len(request.kv.block_ids)
        return None if needed > self.pool.num_free_blocks else needed

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Blocks whose tokens are all computed by the end of this step become shareable:
        # within one forward pass each layer writes K/V before any attention reads it.
        self._update_hashes(request, num_tokens)
        blocks = self.pool.blocks
        start = request.kv.num_hashed_blocks
        full = min(num_tokens // self.block_size, len(request.kv.block_hashes))
        for i in range(start, full):
            self.pool.cache(blocks[request.kv.block_ids[i]], request.kv.block_hashes[i])
        request.kv.num_hashed_blocks = max(start, full)

    def reserve_lookahead(self, request: Request, num_tokens: int) -> bool:
        """Blocks for `num_tokens` slots after the computed tokens, ahead of the step that
        computes them (a draft model writes its KV there first); False when there is no
        room. Nothing is hashed: those tokens are not computed yet."""
        needed = -(-(request.num_computed_tokens + num_tokens) // self.block_size) - len(request.kv.block_ids)
        if needed > self.pool.num_free_blocks:
            return False
        if needed > 0:
            request.kv.block_ids.extend(b.block_id for b in self.pool.take(needed))
        return True

    def trim(self, request: Request) -> None:
        """Release the blocks past the request's tokens (ones that held only rejected
        draft tokens' KV): speculation's rollback. Those blocks were never hashed."""
        keep = -(-request.num_tokens // self.block_size)
        ids = request.kv.block_ids
        if len(ids) > keep:
            blocks = self.pool.blocks
            dropped = ids[keep:]
            del ids[keep:]
            request.kv.version, request.kv.kept = request.kv.version + 1, keep  # copies rewrite from here
            self.pool.release([blocks[i] for i in reversed(dropped)])

    def free(self, request: Request) -> None:
        kv, blocks = request.kv, self.pool.blocks
        ids = kv.block_ids
        kv.block_ids, kv.num_hashed_blocks, kv.version, kv.kept = [], 0, kv.version + 1, 0
        self.pool.release([blocks[i] for i in reversed(ids)])
