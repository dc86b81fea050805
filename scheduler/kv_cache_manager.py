"""Per-request block tables on top of the block pool: prefix lookups,
allocation for the next chunk, caching of computed full blocks, freeing."""
from __future__ import annotations

from collections.abc import Iterable, Sequence

from scheduler.block_pool import BlockPool, KVBlock
from scheduler.request import Request


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_caching: bool = True, sliding_window: int = 0):
        """`sliding_window` > 0: every layer sees only that many latest positions, so blocks
        wholly before them are given back while the request runs (`free_out_of_window`)."""
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.sliding_window = sliding_window
        self.block_pool = BlockPool(num_blocks, enable_caching)
        self.req_to_blocks: dict[str, list[KVBlock]] = {}
        # How many leading blocks of each request are registered in the
        # prefix cache (hits, or blocks this request filled and computed).
        self.num_cached_blocks: dict[str, int] = {}
        # Prefix cache counters, in tokens like vLLM: tokens looked up and
        # tokens found, counted once per successful admission.
        self.prefix_cache_queries = 0
        self.prefix_cache_hits = 0
        self.pending_copies: list[tuple[int, int, int]] = []  # partial hits for the next plan's kv_copies

    # --- lookups ----------------------------------------------------------
    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """The longest run of cached full blocks at the start of the request,
        and the number of tokens they hold. At most `num_tokens - 1` tokens
        are served from the cache: the last known token must be computed to
        produce the logits the next token is sampled from."""
        if not self.enable_caching or request.computes_whole_prompt:
            # Prompt logprobs need the logits of every prompt position, MEAN/CLS pooling its hidden states.
            return [], 0
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for block_hash in request.block_hashes[:max_hit_blocks]:
            block = self.block_pool.get_cached_block(block_hash)
            if block is None:
                break
            hits.append(block)
        return hits, len(hits) * self.block_size

    def get_partial_hit(self, request: Request, num_hit_blocks: int) -> tuple[KVBlock, int] | None:
        """After the request's `num_hit_blocks` whole-block hits: a cached block with the same
        parent whose first tokens equal the request's next ones, and how many (leaving the
        last known token to compute). Their KV is copied, not computed (`partial_block_index`)."""
        if (not self.enable_caching or request.computes_whole_prompt or request.images
                or not 0 < num_hit_blocks <= len(request.block_hashes)):
            return None  # the first block's hash holds the salt and adapter; images change KV
        start = num_hit_blocks * self.block_size
        limit = min(self.block_size, request.num_tokens - 1 - start)
        if limit <= 0:
            return None
        return self.block_pool.partial_index.longest_match(
            request.block_hashes[num_hit_blocks - 1], request.all_token_ids[start:start + limit])

    def uncached_block_hashes(self, requests: Iterable[Request]) -> set:
        """Hashes of the full blocks these requests hold but have not registered yet
        (being computed, or scheduled to be)."""
        found: set = set()
        for request in requests:
            start = self.num_cached_blocks.get(request.request_id, 0)
            held = len(self.req_to_blocks.get(request.request_id, ()))
            found.update(request.block_hashes[start:held])
        return found

    def next_block_in_flight(self, request: Request, num_hit_blocks: int, in_flight: set) -> bool:
        """Whether the first block `request` would compute itself (after its `num_hit_blocks`
        prefix hits) is one another request is computing now, and could be a hit next step."""
        if request.computes_whole_prompt:
            return False  # computes every prompt position anyway
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        return num_hit_blocks < max_hit_blocks and request.block_hashes[num_hit_blocks] in in_flight

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        """Count a lookup whose request was admitted (a request that waits and
        is looked up again next step is not counted twice)."""
        if self.enable_caching:
            self.prefix_cache_queries += num_queried_tokens
            self.prefix_cache_hits += num_hit_tokens

    # --- allocation -------------------------------------------------------
    def allocate_slots(self, request: Request, num_new_tokens: int, new_computed_blocks: Sequence[KVBlock] = (),
                       partial_hit: tuple[KVBlock, int] | None = None) -> list[int] | None:
        """Make room for `num_new_tokens` tokens after the request's computed
        ones (its own plus `new_computed_blocks`, prefix hits of a request
        being admitted, plus the tokens of `partial_hit` that the first fresh
        block receives by copy). Returns the ids of the blocks added to the
        request's table (hits first), or None, changing nothing, when too few
        blocks are free."""
        blocks = self.req_to_blocks.get(request.request_id, [])
        if (new_computed_blocks or partial_hit) and blocks:
            raise ValueError(f"{request.request_id}: prefix hits are only taken on admission")
        num_copied = partial_hit[1] if partial_hit else 0
        num_computed = request.num_computed_tokens + len(new_computed_blocks) * self.block_size + num_copied
        num_required = cdiv(num_computed + num_new_tokens, self.block_size)
        num_fresh = max(0, num_required - len(blocks) - len(new_computed_blocks))
        # Hits sitting in the free queue stop being free once touched; so does the copy's
        # source while fresh blocks are taken (the worker copies before this step writes any KV).
        held = [*new_computed_blocks, partial_hit[0]] if partial_hit else new_computed_blocks
        num_revived = sum(1 for block in held if block.ref_cnt == 0)
        if num_fresh > self.block_pool.num_free_blocks - num_revived:
            return None

        if request.request_id not in self.req_to_blocks:
            self.req_to_blocks[request.request_id] = blocks
            self.num_cached_blocks[request.request_id] = len(new_computed_blocks)
        # Touch before popping fresh blocks, so the hits cannot be evicted.
        self.block_pool.touch(new_computed_blocks)
        if partial_hit:
            self.block_pool.touch([partial_hit[0]])
        added = list(new_computed_blocks) + self.block_pool.get_new_blocks(num_fresh)
        if partial_hit:
            self.block_pool.free_blocks([partial_hit[0]])
            self.pending_copies.append((partial_hit[0].block_id, added[len(new_computed_blocks)].block_id, num_copied))
        blocks.extend(added)
        return [block.block_id for block in added]

    def take_copies(self) -> list[tuple[int, int, int]]:
        """The partial hits' copies since the last call: (source block, destination block, tokens)."""
        copies, self.pending_copies = self.pending_copies, []
        return copies

    def fork(self, parent: Request, child: Request) -> int:
        """Give `child`, a new sample of the parent's prompt, read-only shares
        (by ref count) of the parent's computed full blocks, leaving at least
        its last prompt token to compute (its first token is sampled from
        those logits). Returns the number of tokens shared."""
        parent_blocks = self.req_to_blocks[parent.request_id]
        num_shared = min((child.num_tokens - 1) // self.block_size,
                         parent.num_computed_tokens // self.block_size, len(parent_blocks))
        if child.request_id in self.req_to_blocks:
            raise ValueError(f"{child.request_id} already holds blocks")
        shared = parent_blocks[:num_shared]
        self.block_pool.touch(self._real(shared))
        self.req_to_blocks[child.request_id] = list(shared)
        # The parent registered them already (if caching is on); never again by the child.
        self.num_cached_blocks[child.request_id] = num_shared
        return num_shared * self.block_size

    def cache_blocks(self, request: Request) -> None:
        """Register the request's full blocks whose tokens are all computed.
        Call after the step that computed them ran (never for KV that is only
        scheduled)."""
        if not self.enable_caching:
            return
        request_id = request.request_id
        # Only blocks of known tokens have hashes: KV of checked drafts is computed before they join.
        num_full = min(request.num_computed_tokens // self.block_size, len(request.block_hashes))
        start = self.num_cached_blocks[request_id]
        if num_full <= start:
            return
        blocks = self.req_to_blocks[request_id]
        hashes, size, tokens = request.block_hashes, self.block_size, request.all_token_ids
        contents = None if request.images else [
            (hashes[index - 1], tokens[index * size:(index + 1) * size]) if index else None
            for index in range(start, num_full)]
        self.block_pool.cache_full_blocks(blocks[start:num_full], hashes[start:num_full], contents)
        self.num_cached_blocks[request_id] = num_full

    def trim(self, request: Request, num_tokens: int) -> bool:
        """Give back the request's blocks past its first `num_tokens` slots (rejected drafts and a
        draft model's lookahead); never a block registered in the prefix cache. Whether any went."""
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return False
        keep = max(cdiv(num_tokens, self.block_size), self.num_cached_blocks.get(request.request_id, 0))
        if keep >= len(blocks):
            return False
        self.block_pool.free_blocks(reversed(blocks[keep:]))
        del blocks[keep:]
        return True

    def free_out_of_window(self, request: Request) -> int:
        """With a sliding window on every layer: give back the request's blocks that hold only
        positions no later token can see (before `num_computed_tokens - window + 1`); their
        places in the table become the null block. Registered blocks stay in the prefix cache
        (free, evictable). Call after `cache_blocks`. Returns the number freed."""
        if self.sliding_window <= 0:
            return 0
        blocks = self.req_to_blocks.get(request.request_id)
        if not blocks:
            return 0
        first_visible = request.num_computed_tokens - self.sliding_window + 1
        num_out = min(max(0, first_visible) // self.block_size, len(blocks))
        null = self.block_pool.null_block
        freed = [block for block in blocks[:num_out] if block is not null]
        if freed:
            blocks[:num_out] = [null] * num_out
            self.block_pool.free_blocks(freed)
        return len(freed)

    def free(self, request: Request) -> None:
        """Release the request's blocks, tail first, so a sequence's last
        blocks are evicted before its (more shareable) leading ones."""
        blocks = self.req_to_blocks.pop(request.request_id, [])
        self.num_cached_blocks.pop(request.request_id, None)
        self.block_pool.free_blocks(reversed(self._real(blocks)))

    def _real(self, blocks: list[KVBlock]) -> list[KVBlock]:
        """`blocks` without the null block that stands for freed out-of-window ones."""
        null = self.block_pool.null_block
        return [block for block in blocks if block is not null]

    # --- views ------------------------------------------------------------
    def get_block_ids(self, request_id: str) -> list[int]:
        return [block.block_id for block in self.req_to_blocks.get(request_id, [])]

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def usage(self) -> float:
        return self.block_pool.usage

    def reset_prefix_cache(self) -> bool:
        return self.block_pool.reset_prefix_cache()
