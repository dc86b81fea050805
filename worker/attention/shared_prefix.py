"""Shared-prefix ("cascade") decode attention on CPU: which decodes of a step share their
leading KV blocks, found once per step, and the per-layer call that attends them.

Decodes whose block tables begin with the same block ids (prefix cache hits) form groups; the
C++ kernel `shared_prefix_attention` scores every member's query rows against the shared blocks
at once, then continues each member over its own blocks. Ungrouped decodes and prefill chunks
keep going through `paged_attention`. PAGEDSERVE_SHARED_PREFIX_ATTENTION=0 turns it off.
"""
from __future__ import annotations

import os

import numpy as np
import torch

from worker.attention.metadata import AttentionMetadata
from worker.kernels import cpu_ops

ENV_SWITCH = "PAGEDSERVE_SHARED_PREFIX_ATTENTION"
MAX_ROWS_PER_KV_HEAD = 64  # the kernel's limit on query heads per KV head
# Grouping pays off on long prefixes with short tails (measured: a 1,536-token prefix with ~110
# own positions gains; one block of 128 with 64 own loses): a decode joins a group only while its
# own positions are at most this share of the prefix.
MAX_OWN_SHARE = 0.25


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").strip().lower() not in ("0", "false", "no", "off")


def find_groups(block_tables: np.ndarray, seq_lens: np.ndarray, block_size: int,
                max_own_share: float = MAX_OWN_SHARE) -> list[tuple[list[int], int]]:
    """Groups of decodes (row indices) sharing leading blocks, each with its number of shared
    blocks: [(members, blocks)], every group of at least two members and one block.

    Only blocks wholly before a decode's current position count (the block it writes into is its
    own). Rows sorted by their tables put the longest common prefixes side by side; a run of
    neighbours grows while the shared prefix it keeps saves at least as much as before
    ((members - 1) x blocks); members whose own positions exceed `max_own_share` x the prefix's
    are then left out."""
    n = block_tables.shape[0]
    if n < 2:
        return []
    usable = np.minimum((seq_lens.astype(np.int64) - 1) // block_size, block_tables.shape[1])
    rows = np.nonzero(usable >= 1)[0]
    if rows.size < 2:
        return []
    width = int(usable[rows].max())
    table = block_tables[rows, :width].astype(np.int64)
    # Past its usable blocks, a row holds values no other row has (-1 - its index).
    beyond = np.arange(width)[None, :] >= usable[rows][:, None]
    table = np.where(beyond, -1 - np.arange(rows.size)[:, None], table)
    order = np.lexsort(table.T[::-1])
    table = table[order]
    equal = table[1:] == table[:-1]
    lcp = np.where(equal.all(axis=1), width, np.argmin(equal, axis=1)).tolist()
    groups: list[tuple[list[int], int]] = []
    members, shared = [int(rows[order[0]])], 0
    for i, common in enumerate(lcp):
        nxt = int(rows[order[i + 1]])
        if common > 0 and (len(members) == 1 or len(members) * min(common, shared) >= (len(members) - 1) * shared):
            shared = common if len(members) == 1 else min(common, shared)
            members.append(nxt)
            continue
        if len(members) >= 2:
            groups.append((members, shared))
        members, shared = [nxt], 0
    if len(members) >= 2:
        groups.append((members, shared))
    kept = []
    for members, shared in groups:
        limit = max_own_share * shared * block_size
        members = [m for m in members if seq_lens[m] - shared * block_size <= limit]
        if len(members) >= 2:
            kept.append((members, shared))
    return kept


class SharedPrefixPlan:
    """One step's groups (kernel tensors) and the other sequences' own metadata."""

    def __init__(self, meta: AttentionMetadata, groups: list[tuple[list[int], int]], block_size: int,
                 skip: frozenset[int] = frozenset()):
        members = [m for group, _ in groups for m in group]
        self.members = torch.tensor(members, dtype=torch.int32)
        self.group_start = torch.tensor(np.cumsum([0] + [len(g) for g, _ in groups]), dtype=torch.int32)
        self.prefix_lens = torch.tensor([blocks * block_size for _, blocks in groups], dtype=torch.int32)
        grouped = set(members)
        rest = [s for s in range(meta.num_seqs) if s not in grouped and s not in skip]
        starts = meta.query_start_loc_cpu
        self.rest_slice: tuple[int, int] | None = None
        self.rest_tokens: torch.Tensor | None = None
        if not rest:
            return
        lens = [starts[s + 1] - starts[s] for s in rest]
        self.rest_query_start = torch.tensor(np.cumsum([0] + lens), dtype=torch.int32)
        index = torch.tensor(rest, dtype=torch.long)
        self.rest_block_tables = meta.block_tables.index_select(0, index).contiguous()
        self.rest_seq_lens = meta.seq_lens.index_select(0, index).contiguous()
        if rest == list(range(rest[0], rest[-1] + 1)):  # one run of tokens: attend it in place
            self.rest_slice = (starts[rest[0]], starts[rest[-1] + 1])
        else:
            self.rest_tokens = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in rest])

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
               scale: float) -> torch.Tensor:
        """query [T, H, D] (K/V already in the caches) -> [T, H, D]."""
        query = query.contiguous()
        output = torch.empty(query.shape, dtype=query.dtype)
        if self.rest_slice is not None:
            a, b = self.rest_slice
            cpu_ops.paged_attention(output[a:b], query[a:b], k_cache, v_cache, self.rest_block_tables,
                                    self.rest_query_start, self.rest_seq_lens, scale, None)
        elif self.rest_tokens is not None:
            rest_query = query.index_select(0, self.rest_tokens)
            rest_output = torch.empty_like(rest_query)
            cpu_ops.paged_attention(rest_output, rest_query, k_cache, v_cache, self.rest_block_tables,
                                    self.rest_query_start, self.rest_seq_lens, scale, None)
            output.index_copy_(0, self.rest_tokens, rest_output)
        cpu_ops.shared_prefix_attention(output, query, k_cache, v_cache, meta.block_tables, meta.query_start_loc,
                                        meta.seq_lens, self.group_start, self.members, self.prefix_lens, scale)
        return output


class SharedPrefixPlanner:
    """Decides per step whether the grouped path applies, and keeps the step's plan for every
    layer (the metadata object identifies the step: it must not change once the step began)."""

    def __init__(self) -> None:
        self.active = enabled() and cpu_ops.shared_prefix_attention_available()
        self._meta: AttentionMetadata | None = None
        self._plans: dict[int, SharedPrefixPlan | None] = {}

    def plan(self, meta: AttentionMetadata, query: torch.Tensor, k_cache: torch.Tensor,
             sliding_window: int | None, skip: frozenset[int] = frozenset()) -> SharedPrefixPlan | None:
        """The step's plan, or None: use paged_attention for the whole batch. `skip`: sequences
        the plan leaves alone (their rows of the output are left unset); the same for a step."""
        if not self.active or sliding_window is not None or meta.num_decodes < 2:
            return None
        heads, dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        if (query.dtype not in (torch.float32, torch.bfloat16) or
                k_cache.dtype not in (query.dtype, torch.bfloat16) or dim % 16 or
                heads // num_kv_heads > MAX_ROWS_PER_KV_HEAD):
            return None
        if meta is not self._meta:
            self._meta, self._plans = meta, {}
        block_size = k_cache.shape[1]
        if block_size not in self._plans:
            decodes = meta.num_decodes
            groups = find_groups(meta.block_tables[:decodes].numpy(), np.asarray(meta.seq_lens_cpu[:decodes]),
                                 block_size)
            self._plans[block_size] = SharedPrefixPlan(meta, groups, block_size, skip) if groups else None
        return self._plans[block_size]
