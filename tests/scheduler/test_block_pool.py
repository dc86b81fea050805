"""The block pool: free-queue order, ref counts, evict-on-reuse, reset."""
import pytest

from scheduler.block_pool import BlockPool, FreeBlockQueue, KVBlock
from scheduler.prefix_hash import hash_block_tokens, ROOT_BLOCK_HASH


def fake_hash(i: int) -> bytes:
    return hash_block_tokens(ROOT_BLOCK_HASH, [i])


def test_free_queue_is_doubly_linked_and_ordered():
    blocks = [KVBlock(i) for i in range(6)]
    queue = FreeBlockQueue(blocks)
    assert queue.block_ids() == [0, 1, 2, 3, 4, 5]
    queue.remove(blocks[3])  # from the middle
    queue.remove(blocks[0])  # the head
    queue.remove(blocks[5])  # the tail
    assert queue.block_ids() == [1, 2, 4]
    assert queue.num_free_blocks == 3
    queue.append(blocks[3])
    assert queue.popleft() is blocks[1]
    assert queue.block_ids() == [2, 4, 3]
    assert [b.block_id for b in queue.popleft_n(3)] == [2, 4, 3]
    assert queue.num_free_blocks == 0
    with pytest.raises(ValueError):
        queue.popleft()
    with pytest.raises(ValueError):
        queue.remove(blocks[2])  # not in the queue any more
    queue.append(blocks[2])
    with pytest.raises(ValueError):
        queue.append(blocks[2])  # twice


def test_block_zero_is_never_handed_out():
    pool = BlockPool(5)
    assert pool.num_usable_blocks == 4
    assert pool.free_block_queue.block_ids() == [1, 2, 3, 4]
    assert [b.block_id for b in pool.get_new_blocks(4)] == [1, 2, 3, 4]
    assert pool.num_free_blocks == 0 and pool.usage == 1.0
    with pytest.raises(ValueError):
        pool.get_new_blocks(1)
    with pytest.raises(ValueError):
        pool.free_blocks([pool.null_block])
    with pytest.raises(ValueError):
        BlockPool(1)


def test_free_appends_in_given_order_and_reuses_least_recently_freed_first():
    pool = BlockPool(11)
    first = pool.get_new_blocks(3)  # 1, 2, 3
    second = pool.get_new_blocks(2)  # 4, 5
    assert pool.num_used_blocks == 5 and pool.usage == 0.5
    pool.free_blocks(reversed(first))
    pool.free_blocks(reversed(second))
    assert pool.free_block_queue.block_ids() == [6, 7, 8, 9, 10, 3, 2, 1, 5, 4]
    assert [b.block_id for b in pool.get_new_blocks(6)] == [6, 7, 8, 9, 10, 3]
    assert all(b.ref_cnt == 1 for b in pool.blocks[6:11])


def test_shared_block_is_freed_only_by_its_last_holder():
    pool = BlockPool(4)
    [block] = pool.get_new_blocks(1)
    pool.touch([block])
    assert block.ref_cnt == 2
    pool.free_blocks([block])
    assert block.ref_cnt == 1 and pool.free_block_queue.block_ids() == [2, 3]
    pool.free_blocks([block])
    assert block.ref_cnt == 0 and pool.free_block_queue.block_ids() == [2, 3, 1]
    with pytest.raises(ValueError):
        pool.free_blocks([block])


def test_cached_free_block_stays_findable_until_reused():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)  # 1, 2
    pool.cache_full_blocks([a, b], [fake_hash(1), fake_hash(2)])
    pool.free_blocks([b, a])
    assert pool.free_block_queue.block_ids() == [3, 2, 1]
    assert pool.get_cached_block(fake_hash(1)) is a
    assert pool.get_cached_block(fake_hash(2)) is b

    # A prefix hit revives a free block from the middle of the queue.
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.free_block_queue.block_ids() == [3, 1]
    assert pool.num_evicted_blocks == 0

    # Reuse: 3 has no hash; 1 is evicted when popped.
    assert [x.block_id for x in pool.get_new_blocks(2)] == [3, 1]
    assert pool.get_cached_block(fake_hash(1)) is None
    assert a.block_hash is None
    assert pool.num_evicted_blocks == 1
    assert pool.get_cached_block(fake_hash(2)) is b  # still in use, still cached


def test_one_block_per_hash():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a], [fake_hash(7)])
    pool.cache_full_blocks([b], [fake_hash(7)])  # same content computed twice
    assert pool.get_cached_block(fake_hash(7)) is a
    assert b.block_hash is None
    pool.free_blocks([a, b])
    # Reusing `b` (no hash) must not touch the mapping of `a`.
    assert [x.block_id for x in pool.get_new_blocks(2)] == [3, 1]
    assert pool.get_cached_block(fake_hash(7)) is None


def test_caching_disabled_registers_nothing():
    pool = BlockPool(4, enable_caching=False)
    blocks = pool.get_new_blocks(2)
    pool.cache_full_blocks(blocks, [fake_hash(1), fake_hash(2)])
    assert pool.cached_block_hash_to_block == {}
    assert all(b.block_hash is None for b in blocks)


def test_reset_prefix_cache_refuses_while_blocks_are_in_use():
    pool = BlockPool(4)
    a, b = pool.get_new_blocks(2)
    pool.cache_full_blocks([a, b], [fake_hash(1), fake_hash(2)])
    pool.free_blocks([a])
    assert pool.reset_prefix_cache() is False
    assert pool.get_cached_block(fake_hash(1)) is a  # unchanged
    pool.free_blocks([b])
    assert pool.reset_prefix_cache() is True
    assert pool.cached_block_hash_to_block == {}
    assert a.block_hash is None and b.block_hash is None
    assert pool.num_free_blocks == 3


def test_a_pool_of_millions_of_blocks_makes_only_those_it_hands_out():
    import tracemalloc
    tracemalloc.start()
    pool = BlockPool(4_000_001)  # a tiny model under the default 4 GiB: millions of 4-token blocks
    taken = pool.get_new_blocks(3)
    _, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()
    assert peak < 1 << 20  # one object a block would be hundreds of MB
    assert [b.block_id for b in taken] == [1, 2, 3] and pool.num_free_blocks == 3_999_997
    pool.free_blocks(taken)
    assert pool.num_free_blocks == 4_000_000 and pool.num_used_blocks == 0


def test_an_untouched_block_taken_out_of_turn_is_skipped_when_its_turn_comes():
    pool = BlockPool(6)
    pool.touch([pool.blocks[3]])  # still in the never-handed-out range
    assert pool.free_block_queue.block_ids() == [1, 2, 4, 5] and pool.num_free_blocks == 4
    with pytest.raises(ValueError):
        pool.free_block_queue.remove(pool.blocks[3])
    assert [b.block_id for b in pool.get_new_blocks(3)] == [1, 2, 4]
    pool.free_blocks([pool.blocks[3]])
    assert pool.free_block_queue.block_ids() == [5, 3]
    with pytest.raises(ValueError):
        pool.free_block_queue.append(pool.blocks[5])  # untouched: already free
    assert [b.block_id for b in pool.get_new_blocks(2)] == [5, 3] and pool.num_free_blocks == 0
