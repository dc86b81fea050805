"""Prefix lookups, allocation and caching with exact block ids (11 blocks of 4
tokens, like vLLM's tests/v1/core/test_prefix_caching.py)."""
from scheduler.kv_cache_manager import KVCacheManager
from scheduler.request import Request
from tests.scheduler.fake_worker import make_request

BLOCK_SIZE = 4


def new_request(request_id: str, prompt: list[int], caching: bool = True, cache_salt: str | None = None) -> Request:
    return Request(make_request(request_id, prompt, cache_salt=cache_salt), arrival_order=0, max_model_len=64,
                   block_size=BLOCK_SIZE, enable_caching=caching)


def admit(manager: KVCacheManager, request: Request, num_new_tokens: int | None = None) -> list[int] | None:
    """What the scheduler does on admission, then 'computes' the chunk."""
    hits, num_hit = manager.get_computed_blocks(request)
    num_new = request.num_tokens - num_hit if num_new_tokens is None else num_new_tokens
    block_ids = manager.allocate_slots(request, num_new, hits)
    if block_ids is not None:
        manager.record_prefix_lookup(request.num_tokens, num_hit)
        request.num_computed_tokens = num_hit + num_new
        manager.cache_blocks(request)
    return block_ids


def free_ids(manager: KVCacheManager) -> list[int]:
    return manager.block_pool.free_block_queue.block_ids()


def ref_counts(manager: KVCacheManager) -> list[int]:
    return [block.ref_cnt for block in manager.block_pool.blocks]


def test_prefix_hit_shares_blocks_and_free_order_is_lru():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    common = list(range(12))  # three full blocks
    a = new_request("a", common + [100, 101])
    assert manager.get_computed_blocks(a) == ([], 0)
    assert admit(manager, a) == [1, 2, 3, 4]
    assert len(manager.block_pool.cached_block_hash_to_block) == 3  # the partial block is not cached
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10]

    b = new_request("b", common + [200, 201, 202])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2, 3] and num_hit == 12
    assert admit(manager, b) == [1, 2, 3, 5]
    assert ref_counts(manager) == [0, 2, 2, 2, 1, 1, 0, 0, 0, 0, 0]
    assert (manager.prefix_cache_queries, manager.prefix_cache_hits) == (14 + 15, 12)

    manager.free(a)  # only its private block 4 becomes free
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4]
    manager.free(b)  # reverse order: the tail block 5 is evicted before the shared prefix
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 5, 3, 2, 1]
    assert manager.num_free_blocks == 10 and manager.usage == 0.0


def test_whole_prompt_cached_still_computes_the_last_block():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    prompt = list(range(12))
    a = new_request("a", prompt + [99])
    admit(manager, a)  # [1, 2, 3, 4]
    manager.free(a)
    c = new_request("c", prompt)  # exactly three full, cached blocks
    hits, num_hit = manager.get_computed_blocks(c)
    assert [blk.block_id for blk in hits] == [1, 2] and num_hit == 8
    # Hits leave the free queue; the recomputed last block is a fresh one from the head.
    assert manager.allocate_slots(c, 4, hits) == [1, 2, 5]
    assert free_ids(manager) == [6, 7, 8, 9, 10, 4, 3]


def test_evict_on_reuse_drops_the_hash_when_a_cached_free_block_is_popped():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    a = new_request("a", list(range(14)))
    admit(manager, a)
    manager.free(a)
    assert free_ids(manager) == [5, 6, 7, 8, 9, 10, 4, 3, 2, 1]
    big = new_request("big", list(range(1000, 1028)))  # seven blocks
    assert admit(manager, big) == [5, 6, 7, 8, 9, 10, 4]
    assert manager.block_pool.num_evicted_blocks == 0  # 4 held no hash (partial block)
    assert len(manager.block_pool.cached_block_hash_to_block) == 3 + 7
    manager.free(big)

    assert free_ids(manager) == [3, 2, 1, 4, 10, 9, 8, 7, 6, 5]
    d = new_request("d", list(range(2000, 2005)))
    assert admit(manager, d) == [3, 2]  # LRU: a's third block, then its second
    assert manager.block_pool.num_evicted_blocks == 2
    # a's first block survives, the chain after it is gone.
    hits, num_hit = manager.get_computed_blocks(new_request("again", list(range(14))))
    assert [blk.block_id for blk in hits] == [1] and num_hit == 4


def test_allocation_fails_without_side_effects_when_blocks_run_out():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)  # 4 usable
    a = new_request("a", list(range(9)))
    assert admit(manager, a) == [1, 2, 3]
    b = new_request("b", list(range(100, 108)))
    assert manager.allocate_slots(b, 8) is None
    assert "b" not in manager.req_to_blocks and free_ids(manager) == [4]
    # A decode that stays in the last block needs nothing new; crossing into a new one takes block 4.
    a.append_output_token(7)
    assert manager.allocate_slots(a, 1) == []
    a.num_computed_tokens = 10
    for token in (8, 9, 10):
        a.append_output_token(token)
    assert manager.allocate_slots(a, 3) == [4]
    a.num_computed_tokens = 13
    assert manager.allocate_slots(a, 4) is None  # 17 tokens would need a 5th block
    assert manager.get_block_ids("a") == [1, 2, 3, 4]


def test_revived_hits_count_against_free_blocks():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = new_request("a", list(range(9)))
    admit(manager, a)  # [1, 2, 3], caches 1 and 2
    manager.free(a)
    filler = new_request("filler", list(range(500, 502)))
    assert admit(manager, filler) == [4]
    # Two hits (both free) plus one fresh block would need three free blocks; only 1, 2, 3 are free
    # and 1, 2 are the hits themselves, so one fresh block (3) fits.
    b = new_request("b", list(range(8)) + [50, 51, 52, 53, 54])
    hits, num_hit = manager.get_computed_blocks(b)
    assert [blk.block_id for blk in hits] == [1, 2]
    assert manager.allocate_slots(b, 5, hits) is None  # needs 2 fresh blocks, only 1 left after the hits
    assert free_ids(manager) == [3, 2, 1]  # nothing touched
    assert manager.allocate_slots(b, 4, hits) == [1, 2, 3]


def test_generated_tokens_are_cached_once_computed():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    a = new_request("a", [1, 2, 3, 4, 5, 6])
    admit(manager, a)  # [1, 2]; block 1 cached
    a.append_output_token(7)
    a.append_output_token(8)  # block 2 is full of known tokens but token 8 is not computed
    a.num_computed_tokens = 7
    manager.cache_blocks(a)
    assert manager.block_pool.blocks[2].block_hash is None
    a.num_computed_tokens = 8
    manager.cache_blocks(a)
    assert manager.block_pool.blocks[2].block_hash == a.block_hashes[1]
    # A new prompt equal to prompt + generated tokens hits both blocks.
    hits, _ = manager.get_computed_blocks(new_request("b", [1, 2, 3, 4, 5, 6, 7, 8, 9]))
    assert [blk.block_id for blk in hits] == [1, 2]


def test_salt_and_disabled_caching_prevent_hits():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    admit(manager, new_request("a", list(range(9)), cache_salt="tenant-1"))
    assert manager.get_computed_blocks(new_request("b", list(range(9)))) == ([], 0)
    assert manager.get_computed_blocks(new_request("c", list(range(9)), cache_salt="tenant-2")) == ([], 0)
    hits, _ = manager.get_computed_blocks(new_request("d", list(range(9)), cache_salt="tenant-1"))
    assert [blk.block_id for blk in hits] == [1, 2]

    off = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, enable_caching=False)
    admit(off, new_request("a", list(range(9)), caching=False))
    assert off.block_pool.cached_block_hash_to_block == {}
    assert off.get_computed_blocks(new_request("b", list(range(9)), caching=False)) == ([], 0)
    assert (off.prefix_cache_queries, off.prefix_cache_hits) == (0, 0)


def test_sliding_window_frees_blocks_behind_the_window_and_nothing_twice():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE, sliding_window=6)
    request = new_request("w", list(range(20)))  # five full blocks
    assert admit(manager, request, 8) == [1, 2]
    # Next token at position 8 sees positions 3..8: block 0 (positions 0-3) is still needed.
    assert manager.free_out_of_window(request) == 0
    assert manager.allocate_slots(request, 8) == [3, 4]
    request.num_computed_tokens = 16
    manager.cache_blocks(request)
    # Position 16 sees 11..16: blocks 0-1 (positions 0-7) are out of the window; block 2 (8-11) is not.
    assert manager.free_out_of_window(request) == 2
    assert manager.get_block_ids("w") == [0, 0, 3, 4]
    assert manager.free_out_of_window(request) == 0
    # Freed but still registered: another request with the same prefix hits them.
    other = new_request("o", list(range(9)))
    hits, num_hit = manager.get_computed_blocks(other)
    assert [b.block_id for b in hits] == [1, 2] and num_hit == 8
    # A new chunk needs blocks for its positions only: the null places count as held.
    assert manager.allocate_slots(request, 4) == [5]
    manager.free(request)
    assert manager.num_free_blocks == 10 and manager.block_pool.null_block.ref_cnt == 0


def test_no_window_frees_nothing_early():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    request = new_request("w", list(range(20)))
    admit(manager, request)
    assert manager.free_out_of_window(request) == 0 and 0 not in manager.get_block_ids("w")


def admit_with_partial(manager: KVCacheManager, request: Request) -> tuple[list[int], tuple[int, int, int] | None]:
    """The scheduler's admission with partial hits: the block ids added and the copy, if any."""
    hits, num_hit = manager.get_computed_blocks(request)
    partial = manager.get_partial_hit(request, len(hits))
    num_hit += partial[1] if partial else 0
    block_ids = manager.allocate_slots(request, request.num_tokens - num_hit, hits, partial)
    request.num_computed_tokens = request.num_tokens
    manager.cache_blocks(request)
    return block_ids, (partial[0].block_id, block_ids[len(hits)], partial[1]) if partial else None


def test_partial_hit_copies_the_shared_start_of_the_next_block():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    shared = list(range(6))  # one full block and half of the next
    a = new_request("a", shared + [100, 101, 102])
    assert admit_with_partial(manager, a) == ([1, 2, 3], None)
    b = new_request("b", shared + [200, 201, 202])
    # block 0 is a whole hit; tokens 4, 5 are copied from a's block 2 into b's first fresh block
    assert admit_with_partial(manager, b) == ([1, 4, 5], (2, 4, 2))
    c = new_request("c", [0, 1, 2, 3, 4, 7, 7, 7])
    assert admit_with_partial(manager, c)[1] in ((2, 6, 1), (4, 6, 1))  # a's or b's block: both start with 4


def test_partial_hit_leaves_the_last_token_to_compute():
    manager = KVCacheManager(num_blocks=11, block_size=BLOCK_SIZE)
    prompt = list(range(8))  # two full blocks
    admit_with_partial(manager, new_request("a", prompt))
    block_ids, copy = admit_with_partial(manager, new_request("b", prompt))
    assert block_ids == [1, 3] and copy == (2, 3, 3)  # block 0 hit, 3 of block 1 copied, token 7 computed


def test_no_partial_hit_from_another_salt_a_first_block_or_an_evicted_block():
    manager = KVCacheManager(num_blocks=5, block_size=BLOCK_SIZE)
    a = new_request("a", list(range(6)) + [100, 101, 102])
    admit_with_partial(manager, a)
    salted = new_request("s", list(range(6)) + [200], cache_salt="other")
    assert manager.get_partial_hit(salted, len(manager.get_computed_blocks(salted)[0])) is None
    first_block = new_request("f", [0, 1, 9, 9, 9])  # shares only part of block 0: no parent hash to match
    assert manager.get_partial_hit(first_block, 0) is None
    manager.free(a)
    admit_with_partial(manager, new_request("x", [50 + i for i in range(16)]))  # reuses every block
    assert len(manager.block_pool.partial_index) == 3  # x's own blocks 1-3 (block 0 is never indexed)
    b = new_request("b", list(range(6)) + [200, 201])
    assert manager.get_computed_blocks(b) == ([], 0)


def test_partial_source_in_the_free_queue_is_not_taken_as_a_fresh_block():
    manager = KVCacheManager(num_blocks=7, block_size=BLOCK_SIZE)
    a = new_request("a", list(range(6)) + [100, 101])
    assert admit_with_partial(manager, a)[0] == [1, 2]
    x = new_request("x", [50 + i for i in range(8)])
    assert admit_with_partial(manager, x)[0] == [3, 4]
    manager.free(a)
    assert admit_with_partial(manager, new_request("z", [70 + i for i in range(8)]))[0] == [5, 6]
    manager.free(x)
    assert free_ids(manager) == [2, 1, 4, 3]  # a's block 2, the copy's source, is next to be handed out
    b = new_request("b", list(range(6)) + [200, 201, 202, 203, 204, 205])
    assert admit_with_partial(manager, b) == ([1, 4, 3], (2, 4, 2))
    assert free_ids(manager) == [2] and manager.block_pool.blocks[2].block_hash is not None
