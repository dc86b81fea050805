"""Cached full blocks by their parent's hash, with their token ids: partial prefix hits.

The prefix cache matches whole blocks, so a request whose prompt leaves a
cached one in the middle of a block recomputes that block's shared tokens
(on average half a block: ~64 tokens with 128-token blocks, for every
request behind a shared system prompt or RAG context). Where the request's
next block and a cached block have the same parent (so every earlier token
is equal) and the same first tokens, those tokens' KV is equal too: the
worker copies it from the cached block instead of computing it.
"""
from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from scheduler.prefix_hash import BlockHash

KVBlock = Any  # scheduler.block_pool.KVBlock (which imports this module): anything with a block_id

# Siblings compared per lookup, newest first: bounds the cost of a lookup
# when many requests branch off one block (each comparison is a short loop).
MAX_CANDIDATES = 32


class PartialBlockIndex:
    def __init__(self) -> None:
        # parent hash -> {block id: (block, its token ids)}, in registration order
        self._children: dict[BlockHash, dict[int, tuple[KVBlock, tuple[int, ...]]]] = {}
        self._parent_of: dict[int, BlockHash] = {}  # block id -> the parent it is filed under

    def __len__(self) -> int:
        return len(self._parent_of)

    def add(self, block: KVBlock, parent_hash: BlockHash, token_ids: Sequence[int]) -> None:
        self.remove(block)
        self._children.setdefault(parent_hash, {})[block.block_id] = (block, tuple(token_ids))
        self._parent_of[block.block_id] = parent_hash

    def remove(self, block: KVBlock) -> None:
        parent_hash = self._parent_of.pop(block.block_id, None)
        if parent_hash is None:
            return
        siblings = self._children[parent_hash]
        del siblings[block.block_id]
        if not siblings:
            del self._children[parent_hash]

    def blocks(self) -> list[KVBlock]:
        return [block for siblings in self._children.values() for block, _ in siblings.values()]

    def clear(self) -> None:
        self._children.clear()
        self._parent_of.clear()

    def longest_match(self, parent_hash: BlockHash, token_ids: Sequence[int]) -> tuple[KVBlock, int] | None:
        """The cached child of `parent_hash` whose first tokens agree longest with `token_ids`,
        and how many agree; None when none agrees on its first token."""
        siblings = self._children.get(parent_hash)
        if not siblings or not token_ids:
            return None
        best: tuple[KVBlock, int] | None = None
        first = token_ids[0]
        for count, (block, cached) in enumerate(reversed(siblings.values())):
            if count == MAX_CANDIDATES:
                break
            if cached[0] != first:
                continue
            length = 1
            limit = min(len(cached), len(token_ids))
            while length < limit and cached[length] == token_ids[length]:
                length += 1
            if best is None or length > best[1]:
                best = (block, length)
                if length == len(token_ids):
                    break
        return best
