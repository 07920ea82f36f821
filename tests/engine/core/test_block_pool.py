"""The block hashes the prefix cache is keyed on: chained (a block's hash covers every token
before it), the same whether a sequence's blocks are hashed at once or a few at a time, and
blind to a partial last block."""

from __future__ import annotations

import hashlib
from array import array

from kvpilot.engine.core.block_pool import ROOT_HASH, hash_blocks


def _one_at_a_time(tokens: list[int], block: int) -> list[bytes]:
    out, parent = [], ROOT_HASH
    for start in range(0, len(tokens) - block + 1, block):
        data = array("q", tokens[start:start + block]).tobytes()
        parent = hashlib.blake2b(parent + data, digest_size=16).digest()
        out.append(parent)
    return out


def test_hashes_are_chained_per_block_and_ignore_a_partial_last_block():
    tokens = [(i * 7919) % 128_000 for i in range(16 * 5 + 3)]
    hashes = hash_blocks(ROOT_HASH, tokens, 16)
    assert hashes == _one_at_a_time(tokens, 16)
    assert len(hashes) == 5 and len(set(hashes)) == 5
    # The same block after a different prefix is a different block.
    other = hash_blocks(ROOT_HASH, [1] + tokens[1:], 16)
    assert other[0] != hashes[0] and all(a != b for a, b in zip(other, hashes))


def test_hashing_in_pieces_equals_hashing_at_once():
    tokens = list(range(1000, 1000 + 16 * 9))
    head = hash_blocks(ROOT_HASH, tokens[:32], 16)
    tail = hash_blocks(head[-1], tokens[32:], 16)
    assert head + tail == hash_blocks(ROOT_HASH, tokens, 16)
    assert hash_blocks(ROOT_HASH, tokens[:15], 16) == []
