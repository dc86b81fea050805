"""Paged attention on CPU: the compiled C++ kernel when it is available (see
`worker.kernels.cpu_extension`), else plain PyTorch, which also serves other devices.
On CPUs with AMX the kernel leaves bfloat16 prefill chunks to SDPA (see prefill_split).

PyTorch path: decodes (one query token each) are grouped into a few length buckets; each
bucket gathers its K/V from the cache through the block tables and runs two
batched matmuls (faster than SDPA for one query row). Prefill/extend chunks run
one SDPA call per sequence with a causal mask shifted by its context length.

On CPU decode attention is memory-bound: the gather costs about as much as the
matmuls, which is the price of staying in plain PyTorch (a fused C++ kernel
reading blocks in place would avoid it).

Attention logit soft-capping (`softcap`, Gemma 2) runs on the PyTorch path only, prefill
chunks through explicit matmuls instead of SDPA: neither the C++ kernel nor SDPA can cap.
"""
from __future__ import annotations

import os

import torch
import torch.nn.functional as F

from worker.kernels import cpu_ops
from worker.attention.fp8_kv import as_indexable, from_cache, is_fp8, to_cache
from worker.attention.metadata import AttentionMetadata
from worker.attention.prefill_split import KernelSplitter
from worker.attention.shared_prefix import SharedPrefixPlanner

AMX_DECODES_SWITCH = "PAGEDSERVE_AMX_DECODES"  # 1: decodes too on AMX tiles (else the paged kernel)


class TorchAttentionBackend:
    """One instance serves every layer. It remembers the gather indices and masks it
    derived from the last step's metadata object, so layers after the first reuse
    them; a metadata object must therefore not be mutated once a step has begun.

    `use_cpu_kernel`: None (default) uses the C++ kernel for CPU tensors when it
    builds, True insists on it (raises if it cannot be built), False never uses it.
    `sdpa_prefill`: whether the kernel leaves bfloat16 prefill chunks of many rows to another
    route; None (default): on CPUs with AMX. `amx_attention`: whether that route is the AMX
    tile kernel (bfloat16 or 8-bit float caches) rather than SDPA; None (default): where it runs.
    `amx_decodes`: whether the AMX kernel also takes the decodes and short chunks of such steps
    (decodes several to a tile) rather than the paged kernel; None (default): only with
    PAGEDSERVE_AMX_DECODES=1 (measured slower than the paged kernel on L1-shaped decodes)."""

    name = "torch"
    supports_softcap = True

    def __init__(self, use_cpu_kernel: bool | None = None, sdpa_prefill: bool | None = None,
                 amx_attention: bool | None = None, amx_decodes: bool | None = None) -> None:
        self._plans_meta: AttentionMetadata | None = None
        self._decode_plans: dict[tuple, DecodePlan] = {}
        self.use_cpu_kernel = use_cpu_kernel is not False and cpu_ops.load() is not None
        if use_cpu_kernel and not self.use_cpu_kernel:
            raise RuntimeError("the CPU paged attention kernel is unavailable (see the log for why)")
        self._shared_prefix = SharedPrefixPlanner() if self.use_cpu_kernel else None
        if sdpa_prefill is None:
            sdpa_prefill = cpu_ops.amx_bf16_available()
        self._splitter = KernelSplitter() if self.use_cpu_kernel and sdpa_prefill else None
        # The split's long chunks on AMX tiles (bfloat16 caches) rather than through SDPA.
        self._amx_attention = self._splitter is not None and amx_attention is not False and \
            cpu_ops.amx_attention_available()
        if amx_attention and not self._amx_attention:
            raise RuntimeError("AMX attention needs the CPU kernel, the prefill split and AMX-BF16 tiles")
        if amx_decodes is None:
            amx_decodes = os.environ.get(AMX_DECODES_SWITCH, "0").strip().lower() in ("1", "true", "yes", "on")
        self._amx_decodes = self._amx_attention and amx_decodes
        self._all_seqs: tuple[AttentionMetadata | None, torch.Tensor | None] = (None, None)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                *, scale: float, sliding_window: int | None, k_scale: float = 1.0,
                v_scale: float = 1.0, softcap: float | None = None) -> torch.Tensor:
        """query [T, H, D], key/value [T, KVH, D], caches [num_blocks, block_size, KVH, D] -> [T, H, D].
        k_scale/v_scale: an 8-bit cache's per-tensor scales (see worker.attention.fp8_kv);
        softcap: scores capped to tanh(s / softcap) * softcap before the softmax (None: not)."""
        softcap = softcap or None
        use_kernel = (self.use_cpu_kernel and softcap is None and query.device.type == "cpu"
                      and kernel_dtypes(query.dtype, k_cache.dtype))
        if use_kernel and _rows_contiguous(key) and _rows_contiguous(value) and key.dtype == query.dtype:
            cpu_ops.write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        else:
            write_kv_cache(key, value, k_cache, v_cache, meta.slot_mapping, k_scale, v_scale)
        if use_kernel:
            split = (self._splitter.split(meta) if self._splitter is not None and query.dtype == torch.bfloat16
                     else None)
            shared = self._shared_prefix.plan(meta, query, k_cache, sliding_window,
                                              split.sdpa_set if split else frozenset())
            amx = self._amx_attention and sliding_window is None and amx_shapes(query, k_cache)
            if shared is not None:  # decodes sharing prefix blocks attend them together
                output = shared.attend(query, k_cache, v_cache, meta, scale)
            elif amx and self._amx_decodes:  # every sequence on AMX tiles
                query = query.contiguous()
                output = torch.empty(query.shape, dtype=query.dtype)
                cpu_ops.amx_prefill_attention(output, query, k_cache, v_cache, meta.block_tables,
                                              meta.query_start_loc, meta.seq_lens, self._every_seq(meta), scale,
                                              k_scale, v_scale)
                return output
            elif split is None:
                output = torch.empty(query.shape, dtype=query.dtype)
                cpu_ops.paged_attention(output, query.contiguous(), k_cache, v_cache, meta.block_tables,
                                        meta.query_start_loc, meta.seq_lens, scale, sliding_window,
                                        k_scale=k_scale, v_scale=v_scale)
                return output
            else:
                query = query.contiguous()
                output = torch.empty(query.shape, dtype=query.dtype)
                for first, end, a, b, query_start in split.kernel_runs:
                    cpu_ops.paged_attention(output[a:b], query[a:b], k_cache, v_cache, meta.block_tables[first:end],
                                            query_start, meta.seq_lens[first:end], scale, sliding_window,
                                            k_scale=k_scale, v_scale=v_scale)
            if split is None:
                return output
            if amx:
                cpu_ops.amx_prefill_attention(output, query, k_cache, v_cache, meta.block_tables,
                                              meta.query_start_loc, meta.seq_lens, split.sdpa_index, scale,
                                              k_scale, v_scale)
            else:
                self._sdpa_chunks(split.sdpa_seqs, output, query, key, value, k_cache, v_cache, meta, scale,
                                  sliding_window, (k_scale, v_scale))
            return output
        output = torch.empty_like(query)
        num_decodes = meta.num_decodes
        scales = (k_scale, v_scale)
        if num_decodes:
            plan = self._decode_plan(meta, k_cache, sliding_window)
            output[:num_decodes] = plan.attend(query[:num_decodes], k_cache, v_cache, scale, scales, softcap)
        self._sdpa_chunks(range(num_decodes, meta.num_seqs), output, query, key, value, k_cache, v_cache, meta,
                          scale, sliding_window, scales, softcap)
        return output

    @staticmethod
    def _sdpa_chunks(seqs, output: torch.Tensor, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
                     sliding_window: int | None, scales: tuple[float, float], softcap: float | None = None) -> None:
        """Fill the output rows of prefill/extend chunks `seqs`, one SDPA call each."""
        starts = meta.query_start_loc_cpu
        for seq in seqs:
            start, end = starts[seq], starts[seq + 1]
            output[start:end] = _prefill_attention(
                query[start:end], key[start:end], value[start:end], k_cache, v_cache,
                meta.block_tables[seq], meta.seq_lens_cpu[seq], scale, sliding_window, scales, softcap)

    def _every_seq(self, meta: AttentionMetadata) -> torch.Tensor:
        """Every sequence index of the step (int32), made once per step."""
        if self._all_seqs[0] is not meta:
            self._all_seqs = (meta, torch.arange(meta.num_seqs, dtype=torch.int32))
        return self._all_seqs[1]

    def _decode_plan(self, meta: AttentionMetadata, k_cache: torch.Tensor,
                     sliding_window: int | None) -> "DecodePlan":
        if meta is not self._plans_meta:  # a new step
            self._plans_meta, self._decode_plans = meta, {}
        _, block_size, num_kv_heads, _ = k_cache.shape
        key = (block_size, num_kv_heads, sliding_window, k_cache.device)
        plan = self._decode_plans.get(key)
        if plan is None:
            plan = self._decode_plans[key] = DecodePlan(meta, block_size, num_kv_heads, sliding_window,
                                                        k_cache.device)
        return plan


def amx_shapes(query: torch.Tensor, k_cache: torch.Tensor) -> bool:
    """Whether the AMX attention kernel takes these tensors: bfloat16 queries, a bfloat16 or 8-bit
    float cache, head_dim a multiple of 32, blocks a multiple of 16 tokens."""
    return (query.dtype == torch.bfloat16 and (k_cache.dtype == torch.bfloat16 or is_fp8(k_cache.dtype))
            and query.shape[2] % 32 == 0 and k_cache.shape[1] % 16 == 0)


def kernel_dtypes(query_dtype: torch.dtype, cache_dtype: torch.dtype) -> bool:
    """Whether the C++ kernel takes this pair: a cache of the query's dtype, an 8-bit float cache,
    or bfloat16 under float32."""
    return (cache_dtype == query_dtype or is_fp8(cache_dtype)
            or (query_dtype == torch.float32 and cache_dtype == torch.bfloat16))


def _rows_contiguous(x: torch.Tensor) -> bool:
    """All heads of a token lie in one run (a [T, heads, dim] view of a fused projection may)."""
    return x.stride(2) == 1 and x.stride(1) == x.shape[2]


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                   v_cache: torch.Tensor, slot_mapping: torch.Tensor, k_scale: float = 1.0,
                   v_scale: float = 1.0) -> None:
    """Scatter the new tokens' K/V into their cache slots in one indexed copy per tensor
    (8-bit caches: divided by their scales, saturated and rounded first)."""
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    for new, cache, s in ((key, k_cache, k_scale), (value, v_cache, v_scale)):
        as_indexable(cache).view(num_slots, *cache.shape[2:]).index_copy_(
            0, slot_mapping, as_indexable(to_cache(new, cache.dtype, s)))


MIN_BUCKET_SEQS = 8  # fewer decodes than this are not worth their own gather/matmul calls


def bucket_by_length(seq_lens: list[int], block_size: int, sliding_window: int | None) -> list[list[int]]:
    """Group decode indices so each group pads to at most ~2x its members' context:
    lengths (in blocks read) fall into power-of-two classes, longest first, and a
    group closes once it holds MIN_BUCKET_SEQS sequences."""
    def cols(n: int) -> int:
        full = -(-n // block_size)
        return full if sliding_window is None else min(full, (sliding_window + block_size - 2) // block_size + 1)

    order = sorted(range(len(seq_lens)), key=lambda i: cols(seq_lens[i]), reverse=True)
    buckets: list[list[int]] = []
    current: list[int] = []
    for position, index in enumerate(order):
        current.append(index)
        next_index = order[position + 1] if position + 1 < len(order) else None
        same_class = (next_index is not None and
                      (cols(seq_lens[next_index]) - 1).bit_length() == (cols(seq_lens[index]) - 1).bit_length())
        if len(current) >= MIN_BUCKET_SEQS and not same_class:
            buckets.append(current)
            current = []
    if current:
        if buckets:
            buckets[-1].extend(current)
        else:
            buckets.append(current)
    return buckets


class DecodePlan:
    """A step's decodes, split into length buckets, with what does not depend on the layer."""

    def __init__(self, meta: AttentionMetadata, block_size: int, num_kv_heads: int,
                 sliding_window: int | None, device: torch.device):
        batch = meta.num_decodes
        groups = bucket_by_length(meta.seq_lens_cpu[:batch], block_size, sliding_window)
        self.in_order = len(groups) == 1 and groups[0] == sorted(groups[0])
        seq_lens = meta.seq_lens[:batch].to(device=device, dtype=torch.long)
        block_tables = meta.block_tables[:batch].to(device=device, dtype=torch.long)
        self.buckets = []
        for group in groups:
            index = torch.tensor(group, device=device)
            self.buckets.append(DecodeBucket(
                index, seq_lens[index], block_tables[index], max(meta.seq_lens_cpu[i] for i in group),
                block_size, num_kv_heads, sliding_window))

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
               softcap: float | None = None) -> torch.Tensor:
        """query [B, H, D] -> [B, H, D]."""
        if self.in_order:
            return self.buckets[0].attend(query, k_cache, v_cache, scale, kv_scales, softcap)
        output = torch.empty_like(query)
        for bucket in self.buckets:
            out = bucket.attend(query.index_select(0, bucket.index), k_cache, v_cache, scale, kv_scales, softcap)
            output.index_copy_(0, bucket.index, out)
        return output


class DecodeBucket:
    """Decodes padded to one context length: which cache rows to gather (laid out
    [B, KVH, context, D], so the matmuls need no transposes) and an additive mask
    hiding padding and positions outside the window."""

    def __init__(self, index: torch.Tensor, seq_lens: torch.Tensor, block_tables: torch.Tensor,
                 max_len: int, block_size: int, num_kv_heads: int, sliding_window: int | None):
        device = seq_lens.device
        batch = seq_lens.shape[0]
        if sliding_window is not None and max_len > sliding_window:
            # Only the block columns that can hold one of a sequence's last `sliding_window` positions.
            first_col = (seq_lens - sliding_window).clamp(min=0) // block_size
            num_cols = (sliding_window + block_size - 2) // block_size + 1
            cols = first_col[:, None] + torch.arange(num_cols, device=device)
            blocks = torch.gather(block_tables, 1, cols.clamp(max=block_tables.shape[1] - 1))
        else:
            num_cols = (max_len + block_size - 1) // block_size
            cols = torch.arange(num_cols, device=device).expand(batch, num_cols)
            blocks = block_tables[:, :num_cols]
        offsets = torch.arange(block_size, device=device)
        positions = (cols[:, :, None] * block_size + offsets).view(batch, -1)
        slots = (blocks[:, :, None] * block_size + offsets).view(batch, -1)
        visible = positions < seq_lens[:, None]
        if sliding_window is not None:
            visible &= positions >= (seq_lens - sliding_window)[:, None]

        self.index, self.num_kv_heads, self.context = index, num_kv_heads, positions.shape[1]
        # Row r of cache.view(-1, D) is (slot r // KVH, kv head r % KVH).
        heads = torch.arange(num_kv_heads, device=device)
        self.rows = (slots[:, None, :] * num_kv_heads + heads[None, :, None]).reshape(-1)
        self.bias = torch.zeros(batch, 1, 1, self.context, device=device).masked_fill_(
            ~visible[:, None, None, :], float("-inf"))

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, kv_scales: tuple[float, float] = (1.0, 1.0),
               softcap: float | None = None) -> torch.Tensor:
        """query [b, H, D] -> [b, H, D]. Scores and softmax in float32."""
        batch, num_heads, head_dim = query.shape
        shape = (batch, self.num_kv_heads, self.context, head_dim)
        keys = from_cache(_gather_rows(k_cache, self.rows, head_dim), query.dtype, kv_scales[0]).view(shape)
        values = from_cache(_gather_rows(v_cache, self.rows, head_dim), query.dtype, kv_scales[1]).view(shape)
        # GQA without copying K/V: the query heads sharing a KV head are rows of one matmul.
        queries = query.view(batch, self.num_kv_heads, num_heads // self.num_kv_heads, head_dim)
        products = torch.matmul(queries, keys.transpose(-1, -2))
        if softcap is None:
            scores = torch.add(self.bias, products, alpha=scale)
        else:
            scores = self.bias + soft_cap(products.float() * scale, softcap)
        probs = torch.softmax(scores, dim=-1).to(query.dtype)
        return torch.matmul(probs, values).view(batch, num_heads, head_dim)


def _gather_rows(cache: torch.Tensor, rows: torch.Tensor, head_dim: int) -> torch.Tensor:
    """Rows of cache.view(-1, head_dim), in the cache's dtype."""
    return as_indexable(cache).view(-1, head_dim).index_select(0, rows).view(cache.dtype)


def _prefill_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                       k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                       seq_len: int, scale: float, sliding_window: int | None,
                       kv_scales: tuple[float, float] = (1.0, 1.0), softcap: float | None = None) -> torch.Tensor:
    """One prefill/extend chunk: query [Q, H, D] at positions [seq_len - Q, seq_len)."""
    query_len, num_heads, head_dim = query.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    context_len = seq_len - query_len
    # Oldest position any query of this chunk may see.
    first_pos = 0 if sliding_window is None else max(0, context_len - sliding_window + 1)

    if first_pos >= context_len:
        # Nothing needed from earlier steps: attend over the fresh K/V directly (as the cache
        # holds them: rounded like every later step will read them under a narrower cache dtype).
        first_pos = context_len
        keys, values = to_cache(key, k_cache.dtype, kv_scales[0]), to_cache(value, v_cache.dtype, kv_scales[1])
    else:
        first_block = first_pos // block_size
        last_block = (seq_len + block_size - 1) // block_size
        blocks = block_table[first_block:last_block]
        start = first_pos - first_block * block_size
        end = start + seq_len - first_pos
        keys = as_indexable(k_cache).index_select(0, blocks).view(k_cache.dtype).view(-1, num_kv_heads,
                                                                                       head_dim)[start:end]
        values = as_indexable(v_cache).index_select(0, blocks).view(v_cache.dtype).view(-1, num_kv_heads,
                                                                                         head_dim)[start:end]

    q = query.transpose(0, 1).unsqueeze(0)  # [1, H, Q, D]
    k = from_cache(keys, query.dtype, kv_scales[0]).transpose(0, 1).unsqueeze(0)  # [1, KVH, K, D]
    v = from_cache(values, query.dtype, kv_scales[1]).transpose(0, 1).unsqueeze(0)
    gqa = num_heads != num_kv_heads
    if softcap is not None:  # SDPA cannot cap: scores, cap, mask, softmax by hand
        q_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(first_pos, seq_len, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = _capped_attention(q, k, v, mask, scale, softcap)
    elif first_pos == context_len and (sliding_window is None or sliding_window >= query_len):
        # Keys start exactly at the first query: plain top-left causal mask.
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=gqa)
    else:
        q_pos = torch.arange(context_len, seq_len, device=query.device)[:, None]
        k_pos = torch.arange(first_pos, seq_len, device=query.device)[None, :]
        mask = k_pos <= q_pos
        if sliding_window is not None:
            mask &= k_pos > q_pos - sliding_window
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=gqa)
    return out.squeeze(0).transpose(0, 1)


def soft_cap(scores: torch.Tensor, softcap: float) -> torch.Tensor:
    """tanh(scores / softcap) * softcap, as transformers' Gemma 2 attention caps its scores."""
    return torch.tanh(scores / softcap) * softcap


def _capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor,
                      scale: float, softcap: float) -> torch.Tensor:
    """q [1, H, Q, D], k/v [1, KVH, K, D], mask [Q, K] (True: visible) -> [1, H, Q, D], rounded as
    transformers' eager attention rounds (scores and their cap in q's dtype, the softmax in float32);
    the query heads sharing a KV head are rows of one matmul."""
    _, num_heads, query_len, head_dim = q.shape
    num_kv_heads = k.shape[1]
    queries = q.reshape(num_kv_heads, num_heads // num_kv_heads * query_len, head_dim)
    scores = soft_cap(torch.matmul(queries, k[0].transpose(-1, -2)) * scale, softcap)
    scores = scores.view(num_kv_heads, num_heads // num_kv_heads, query_len, -1).masked_fill(~mask, float("-inf"))
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32).to(v.dtype)
    return torch.matmul(probs.view(num_kv_heads, -1, probs.shape[-1]), v[0]).view(1, num_heads, query_len, head_dim)
