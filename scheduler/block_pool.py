"""The KV block pool: ref counts, the LRU free queue and the prefix-cache map.

Block ids are small ints in [0, num_blocks); block 0 is the null block (the
worker pads block tables with it) and is never handed out. A block is either
in use (ref_cnt > 0, held by one or more requests) or in the free queue
(ref_cnt == 0). A free block may still carry a hash: its KV stays valid and a
prefix lookup can revive it until the slot is reused for new tokens
("evict on reuse").
"""
from __future__ import annotations

import logging
from collections.abc import Iterable

from scheduler.partial_block_index import PartialBlockIndex
from scheduler.prefix_hash import BlockHash

logger = logging.getLogger(__name__)


class KVBlock:
    """One block's bookkeeping; `prev_free`/`next_free` link the free queue."""

    __slots__ = ("block_id", "ref_cnt", "block_hash", "prev_free", "next_free")

    def __init__(self, block_id: int):
        self.block_id = block_id
        self.ref_cnt = 0
        self.block_hash: BlockHash | None = None  # set once the block is full, computed and cached
        self.prev_free: KVBlock | None = None
        self.next_free: KVBlock | None = None

    def __repr__(self) -> str:
        cached = "" if self.block_hash is None else f", hash={self.block_hash[:4].hex()}"
        return f"KVBlock(id={self.block_id}, ref_cnt={self.ref_cnt}{cached})"


class LazyBlocks:
    """Every block's `KVBlock` by id, each made on first use. A pool can hold millions of
    blocks (a small model under a large KV budget); making them all up front cost seconds at
    every start, while a server mostly touches a fraction of them."""

    def __init__(self, num_blocks: int):
        self._num_blocks = num_blocks
        self._made: dict[int, KVBlock] = {}

    def __len__(self) -> int:
        return self._num_blocks

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(self._num_blocks))]
        if index < 0:
            index += self._num_blocks
        if not 0 <= index < self._num_blocks:
            raise IndexError(f"block {index} out of range [0, {self._num_blocks})")
        block = self._made.get(index)
        if block is None:
            block = self._made[index] = KVBlock(index)
        return block

    def __iter__(self):
        return (self[i] for i in range(self._num_blocks))


class FreeBlockQueue:
    """Doubly linked list of free blocks; every operation is O(1) per block.

    The head is the next block to hand out (least recently used), the tail the
    most recently freed. A list would need O(n) removal when a prefix hit
    revives a free block from the middle of the queue. Blocks never handed out
    (`untouched`: the ids [start, len) of a `LazyBlocks`) stand before the list
    as a range, made into objects only when popped.
    """

    def __init__(self, blocks: Iterable[KVBlock] = (), untouched: tuple[LazyBlocks, int] | None = None):
        self._head = KVBlock(-1)  # sentinels, never handed out
        self._tail = KVBlock(-1)
        self._head.next_free = self._tail
        self._tail.prev_free = self._head
        self._untouched, self._next_untouched = untouched if untouched is not None else (None, 0)
        self._untouched_end = len(self._untouched) if self._untouched is not None else 0
        self._taken_early: set[int] = set()  # untouched ids removed out of turn
        self.num_free_blocks = self._untouched_end - self._next_untouched
        self.append_n(blocks)

    def _is_untouched(self, block: KVBlock) -> bool:
        return self._next_untouched <= block.block_id < self._untouched_end and block.block_id not in self._taken_early

    def popleft(self) -> KVBlock:
        while self._next_untouched < self._untouched_end:
            block_id = self._next_untouched
            self._next_untouched += 1
            if block_id in self._taken_early:
                self._taken_early.discard(block_id)
                continue
            self.num_free_blocks -= 1
            return self._untouched[block_id]
        block = self._head.next_free
        if block is self._tail:
            raise ValueError("no free blocks left")
        self.remove(block)
        return block

    def popleft_n(self, count: int) -> list[KVBlock]:
        if count > self.num_free_blocks:
            raise ValueError(f"asked for {count} blocks, only {self.num_free_blocks} free")
        return [self.popleft() for _ in range(count)]

    def remove(self, block: KVBlock) -> None:
        if self._is_untouched(block):
            self._taken_early.add(block.block_id)
            self.num_free_blocks -= 1
            return
        if block.prev_free is None or block.next_free is None:
            raise ValueError(f"{block} is not in the free queue")
        block.prev_free.next_free = block.next_free
        block.next_free.prev_free = block.prev_free
        block.prev_free = block.next_free = None
        self.num_free_blocks -= 1

    def append(self, block: KVBlock) -> None:
        if block.prev_free is not None or block.next_free is not None or self._is_untouched(block):
            raise ValueError(f"{block} is already in the free queue")
        last = self._tail.prev_free
        last.next_free = block
        block.prev_free = last
        block.next_free = self._tail
        self._tail.prev_free = block
        self.num_free_blocks += 1

    def append_n(self, blocks: Iterable[KVBlock]) -> None:
        for block in blocks:
            self.append(block)

    def block_ids(self) -> list[int]:
        """Free block ids from head (evicted first) to tail; for tests and debugging."""
        ids = [i for i in range(self._next_untouched, self._untouched_end) if i not in self._taken_early]
        block = self._head.next_free
        while block is not self._tail:
            ids.append(block.block_id)
            block = block.next_free
        return ids


class BlockPool:
    """Owns every block. `num_blocks` counts the null block, so
    `num_blocks - 1` blocks are usable."""

    def __init__(self, num_blocks: int, enable_caching: bool = True):
        if num_blocks < 2:
            raise ValueError(f"need at least 2 blocks (block 0 is reserved), got {num_blocks}")
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = LazyBlocks(num_blocks)
        self.null_block = self.blocks[0]
        self.free_block_queue = FreeBlockQueue(untouched=(self.blocks, 1))
        # One block per hash: when two requests computed the same block in
        # the same step, only the first to finish is registered.
        self.cached_block_hash_to_block: dict[BlockHash, KVBlock] = {}
        self.num_evicted_blocks = 0  # cached free blocks whose slot was reused
        self.partial_index = PartialBlockIndex()  # registered blocks by parent, for partial hits

    # --- sizes ------------------------------------------------------------
    @property
    def num_usable_blocks(self) -> int:
        return self.num_blocks - 1

    @property
    def num_free_blocks(self) -> int:
        return self.free_block_queue.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.num_usable_blocks - self.num_free_blocks

    @property
    def usage(self) -> float:
        """Fraction of usable blocks held by requests (cached free blocks count as free)."""
        return self.num_used_blocks / self.num_usable_blocks

    # --- prefix cache -----------------------------------------------------
    def get_cached_block(self, block_hash: BlockHash) -> KVBlock | None:
        return self.cached_block_hash_to_block.get(block_hash)

    def cache_full_blocks(self, blocks: list[KVBlock], block_hashes: list[BlockHash],
                          contents: list[tuple[BlockHash, list[int]] | None] | None = None) -> None:
        """Register full, computed blocks under their hashes (same length lists). `contents`, if
        given, has per block its parent's hash and its token ids (None: not for partial hits)."""
        if not self.enable_caching:
            return
        for index, (block, block_hash) in enumerate(zip(blocks, block_hashes, strict=True)):
            if block.block_hash is not None:
                continue
            if block_hash in self.cached_block_hash_to_block:
                continue  # same content already cached in another block
            block.block_hash = block_hash
            self.cached_block_hash_to_block[block_hash] = block
            if contents is not None and contents[index] is not None:
                self.partial_index.add(block, *contents[index])

    def _evict(self, block: KVBlock) -> None:
        """Forget a free block's cached content because its slot is reused."""
        if block.block_hash is None:
            return
        if self.cached_block_hash_to_block.get(block.block_hash) is block:
            del self.cached_block_hash_to_block[block.block_hash]
        block.block_hash = None
        self.partial_index.remove(block)
        self.num_evicted_blocks += 1

    def reset_prefix_cache(self) -> bool:
        """Forget every cached hash. Like vLLM, refuses (returns False) while
        any block is in use, since running requests' blocks would have to
        stay registered for their own bookkeeping."""
        if self.num_used_blocks:
            logger.warning("Prefix cache not reset: %d blocks are still in use", self.num_used_blocks)
            return False
        for block in self.cached_block_hash_to_block.values():
            block.block_hash = None
        self.cached_block_hash_to_block.clear()
        self.partial_index.clear()
        return True

    # --- allocation -------------------------------------------------------
    def get_new_blocks(self, count: int) -> list[KVBlock]:
        """Take `count` blocks from the head of the free queue (LRU first),
        evicting any cached content they held."""
        blocks = self.free_block_queue.popleft_n(count)
        for block in blocks:
            self._evict(block)
            block.ref_cnt = 1
        return blocks

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take a reference to cached blocks (prefix hits); a free one leaves
        the free queue so it cannot be evicted while shared."""
        for block in blocks:
            if block.ref_cnt == 0:
                self.free_block_queue.remove(block)
            block.ref_cnt += 1

    def free_blocks(self, ordered_blocks: Iterable[KVBlock]) -> None:
        """Drop one reference from each block; those reaching zero join the
        free queue's tail in the given order (the first is evicted first)."""
        for block in ordered_blocks:
            if block.ref_cnt <= 0 or block is self.null_block:
                raise ValueError(f"freeing {block}, which is not in use")
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                self.free_block_queue.append(block)
