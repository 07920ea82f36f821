"""Fixed-size KV blocks: reference counts, an LRU free queue and the prefix-hash index."""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from dataclasses import dataclass

ROOT_HASH = b""


def hash_blocks(parent_hash: bytes, token_ids: list[int], block_size: int) -> list[bytes]:
    """The chained hashes of each full block of `token_ids`, the first chained to
    `parent_hash`: a block's identity covers every token before it, not just its own. A
    prompt's blocks go at once (its ids become bytes once, not once per block)."""
    data, width = array("q", token_ids).tobytes(), 8 * block_size
    out, blake2b = [], hashlib.blake2b
    for start in range(0, len(data) - width + 1, width):
        parent_hash = blake2b(parent_hash + data[start:start + width], digest_size=16).digest()
        out.append(parent_hash)
    return out


@dataclass(eq=False, slots=True)  # slots: read and written for every block of every step
class KVCacheBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    """Owns every physical block. A block with ref_cnt 0 sits in the free queue; if it
    still carries a hash it can be revived by a prefix hit until it is evicted."""

    def __init__(self, num_blocks: int) -> None:
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be positive, got {num_blocks}")
        self.blocks = [KVCacheBlock(i) for i in range(num_blocks)]
        # Front = evicted first. Uncached blocks go to the front, cached ones to the back.
        self._free: OrderedDict[int, KVCacheBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVCacheBlock] = {}

    @property
    def num_blocks(self) -> int:
        return len(self.blocks)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def lookup(self, block_hash: bytes) -> KVCacheBlock | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[KVCacheBlock] | None:
        """Pop n blocks for new tokens, evicting cached ones in LRU order; None if short."""
        free = self._free
        if n > len(free):
            return None
        taken = []
        for _ in range(n):
            block = free.popitem(last=False)[1]
            if block.block_hash is not None:
                del self._cached[block.block_hash]
                block.block_hash = None
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def touch(self, blocks: list[KVCacheBlock]) -> None:
        """Share already-cached blocks with one more request."""
        for block in blocks:
            if block.ref_cnt == 0:
                del self._free[block.block_id]
            block.ref_cnt += 1

    def release(self, blocks: list[KVCacheBlock]) -> None:
        """Drop one reference each. Pass a request's blocks tail first, so a sequence's
        last blocks are evicted before its (more shareable) first ones."""
        for block in blocks:
            if block.ref_cnt <= 0:
                raise RuntimeError(f"block {block.block_id} released with ref_cnt {block.ref_cnt}")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self._free[block.block_id] = block
                if block.block_hash is None:
                    self._free.move_to_end(block.block_id, last=False)

    def cache(self, block: KVCacheBlock, block_hash: bytes) -> None:
        """Register a full block under its chained hash (first writer wins)."""
        if block.block_hash is not None:
            return
        if block_hash not in self._cached:
            block.block_hash = block_hash
            self._cached[block_hash] = block
