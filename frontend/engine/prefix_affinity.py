"""Which data-parallel replica already holds a prompt's prefix (SGLang's cache-aware
routing idea, on the frontend's side of the wire).

A prompt is cut into full blocks of `block_size` token ids (the scheduler's KV
block size, so a block here is a block its prefix cache can hold); block i's
hash chains every token before it (and the request's `cache_salt`, which starts
the scheduler's own hashes), as the scheduler's prefix hashes do. A bounded LRU
maps each block hash to the set of replicas (a bit mask) that served a prompt
holding it. `match_depths` says, per replica, how many leading blocks of a new
prompt it served: the longest such prefix is the best guess of what its prefix
cache still holds. Only a guess: a replica may have evicted the blocks since.
"""
from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 1 << 16  # block hashes remembered (~100 bytes each)


def block_hashes(token_ids: list[int], block_size: int, salt: str | None = None) -> list[int]:
    """One chained hash per full block of `token_ids`."""
    hashes, previous = [], hash(("pagedserve-prefix", salt))
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        previous = hash((previous, tuple(token_ids[start:start + block_size])))
        hashes.append(previous)
    return hashes


class PrefixAffinity:
    def __init__(self, num_replicas: int, capacity: int = DEFAULT_CAPACITY):
        if num_replicas < 1 or capacity < 1:
            raise ValueError("num_replicas and capacity must be positive")
        self.num_replicas = num_replicas
        self.capacity = capacity
        self._owners: OrderedDict[int, int] = OrderedDict()  # block hash -> bit mask of replicas

    def __len__(self) -> int:
        return len(self._owners)

    def match_depths(self, hashes: list[int]) -> list[int]:
        """For each replica, how many leading blocks of `hashes` it has served."""
        depths = [0] * self.num_replicas
        alive = (1 << self.num_replicas) - 1
        for depth, block in enumerate(hashes, 1):
            alive &= self._owners.get(block, 0)
            if not alive:
                break
            for replica in range(self.num_replicas):
                if alive >> replica & 1:
                    depths[replica] = depth
        return depths

    def record(self, hashes: list[int], replica: int) -> None:
        """`replica` now serves a prompt with these blocks: it holds them (most recently used)."""
        bit = 1 << replica
        for block in hashes:
            self._owners[block] = self._owners.pop(block, 0) | bit
        while len(self._owners) > self.capacity:
            self._owners.popitem(last=False)

    def forget_replica(self, replica: int) -> None:
        """The replica lost its prefix cache (restarted, or its worker was replaced)."""
        keep = ~(1 << replica)
        for block in [b for b, mask in self._owners.items() if mask & ~keep]:
            mask = self._owners[block] & keep
            if mask:
                self._owners[block] = mask
            else:
                del self._owners[block]
