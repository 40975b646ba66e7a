"""The block pool places a sequence's blocks side by side: each block handed out holds back the
free, uncached blocks after it for its sequence (``reserve_ahead``), without changing which
blocks are free, cached or evicted."""

from __future__ import annotations

import itertools

from tailserve.memory.block_pool import BlockPool


def _grow_alternately(pool: BlockPool, steps: int) -> tuple[list[int], list[int]]:
    """Two sequences that start together and then take one block each per step."""
    a, b = pool.allocate(1), pool.allocate(1)
    for _ in range(steps):
        a += pool.allocate(1, after=a[-1])
        b += pool.allocate(1, after=b[-1])
    pool.check_consistency()
    return a, b


def _jumps(blocks: list[int]) -> int:
    return sum(1 for x, y in itertools.pairwise(blocks) if y != x + 1)


def test_sequences_growing_side_by_side_get_runs_not_interleaved_blocks():
    a, b = _grow_alternately(BlockPool(num_blocks=64, block_size=16, reserve_ahead=7), 11)
    assert a[:8] == list(range(8)) and b[:8] == list(range(8, 16))
    # a meets b's run after its 8 and jumps once, past what b holds back; b, the last, never.
    assert _jumps(a) == 1 and _jumps(b) == 0
    # Without runs every block of both is a jump: the free queue's order interleaves them.
    a0, b0 = _grow_alternately(BlockPool(num_blocks=64, block_size=16, reserve_ahead=0), 11)
    assert a0 == list(range(0, 24, 2)) and b0 == list(range(1, 24, 2))
    assert _jumps(a0) == 11 and _jumps(b0) == 11


def test_held_back_blocks_are_free_and_go_to_whoever_needs_them():
    pool = BlockPool(num_blocks=16, block_size=16, reserve_ahead=7)
    first = pool.allocate(2)
    assert first == [0, 1] and pool.num_free_blocks == 14  # 2..8 held back for it, still free
    other = pool.allocate(14)  # everything else, held-back blocks included
    assert sorted(first + other) == list(range(16)) and pool.num_free_blocks == 0
    pool.check_consistency()
    pool.free(other)
    pool.free(first)
    assert pool.num_free_blocks == 16
    pool.check_consistency()


def test_freeing_a_sequence_returns_its_held_back_blocks_in_block_order():
    pool = BlockPool(num_blocks=32, block_size=16, reserve_ahead=3)
    seq = pool.allocate(2)  # 0, 1; holds back 2, 3, 4
    later = pool.allocate(1)  # the free queue's first: 5
    assert seq == [0, 1] and later == [5]
    pool.free(seq)
    assert pool.allocate(5) == [0, 1, 2, 3, 4]  # the freed run and what it held back, in order
    pool.check_consistency()


def test_a_held_back_block_is_taken_before_a_cached_block_is_evicted():
    pool = BlockPool(num_blocks=8, block_size=2, reserve_ahead=2)
    cached = pool.allocate(2)  # 0, 1 (holds back 2, 3)
    hashes = pool.hash_blocks([1, 2, 3, 4], 2)
    pool.cache_block(cached[0], hashes[0], (1, 2))
    pool.cache_block(cached[1], hashes[1], (3, 4), hashes[0])
    pool.free(cached)  # cached and free: reusable until evicted
    running = pool.allocate(4)  # 2, 3 released to the front, then 4, 5 (holding back 6, 7)
    assert running == [2, 3, 4, 5]
    # Only the two held-back blocks and the two cached ones are free: a new sequence takes
    # the held-back ones first and keeps the cached prefix.
    assert pool.allocate(2) == [6, 7]
    assert pool.lookup([1, 2, 3, 4], hashes) == cached and pool.stats.evictions == 0
    pool.check_consistency()
