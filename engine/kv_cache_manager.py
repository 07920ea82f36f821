"""Per-request block tables on top of the block pool, with prefix caching."""

from __future__ import annotations

from dataclasses import dataclass

from .block_pool import ROOT_HASH, BlockPool, KVCacheBlock, hash_block
from .request import Request


@dataclass
class PrefixCacheStats:
    queries: int = 0  # prompt tokens looked up
    hits: int = 0  # of those, tokens found cached


class KVCacheManager:
    """The narrow boundary between scheduler and KV memory: find a cached prefix,
    allocate slots for new tokens (or say None), free a request."""

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks)
        self.req_blocks: dict[str, list[KVCacheBlock]] = {}
        self._num_hashed: dict[str, int] = {}  # blocks of the request already in the index
        self.prefix_stats = PrefixCacheStats()

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def usage(self) -> float:
        """Fraction of blocks held by requests (cached-but-free blocks count as free)."""
        return 1.0 - self.pool.num_free_blocks / self.pool.num_blocks

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def _update_hashes(self, request: Request, num_tokens: int) -> None:
        bs = self.block_size
        hashes = request.block_hashes
        while (len(hashes) + 1) * bs <= num_tokens:
            i = len(hashes)
            parent = hashes[-1] if hashes else ROOT_HASH
            hashes.append(hash_block(parent, request.token_at(i * bs, (i + 1) * bs)))

    def get_computed_blocks(self, request: Request) -> tuple[list[KVCacheBlock], int]:
        """Longest cached prefix of full blocks. At least one token is always left to
        compute, because the last position's logits are needed to sample."""
        if not self.enable_prefix_caching:
            return [], 0
        self._update_hashes(request, request.num_tokens)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit: list[KVCacheBlock] = []
        for block_hash in request.block_hashes[:max_blocks]:
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
    ) -> list[KVCacheBlock] | None:
        """Make room for `num_new_tokens` more tokens after the computed ones (plus any
        prefix-hit blocks, which must not be held by the request yet). None: no room."""
        computed_blocks = computed_blocks or []
        held = self.req_blocks.get(request.request_id, [])
        num_computed = request.num_computed_tokens + len(computed_blocks) * self.block_size
        total = num_computed + num_new_tokens
        needed = -(-total // self.block_size) - len(held) - len(computed_blocks)
        # Reviving cached blocks takes them out of the free queue too.
        evictable_hits = sum(1 for b in computed_blocks if b.ref_cnt == 0)
        if needed > self.pool.num_free_blocks - evictable_hits:
            return None
        self.pool.touch(computed_blocks)
        new = self.pool.take(max(needed, 0)) or []
        blocks = self.req_blocks.setdefault(request.request_id, [])
        blocks.extend(computed_blocks)
        blocks.extend(new)
        if self.enable_prefix_caching:
            self._cache_full_blocks(request, total)
        return new

    def _cache_full_blocks(self, request: Request, num_tokens: int) -> None:
        # Blocks whose tokens are all computed by the end of this step become shareable:
        # within one forward pass each layer writes K/V before any attention reads it.
        self._update_hashes(request, num_tokens)
        blocks = self.req_blocks[request.request_id]
        start = self._num_hashed.get(request.request_id, 0)
        full = min(num_tokens // self.block_size, len(request.block_hashes))
        for i in range(start, full):
            self.pool.cache(blocks[i], request.block_hashes[i])
        self._num_hashed[request.request_id] = max(start, full)

    def free(self, request: Request) -> None:
        blocks = self.req_blocks.pop(request.request_id, [])
        self._num_hashed.pop(request.request_id, None)
        self.pool.release(list(reversed(blocks)))
