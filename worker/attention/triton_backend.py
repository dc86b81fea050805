"""Paged attention backend built on Triton kernels (CUDA; CPU via TRITON_INTERPRET=1).

Importing this module never imports triton: the kernels are loaded when the
backend is constructed, so the CPU-only paths of the worker keep working on
machines without triton.
"""
from __future__ import annotations

import importlib
from types import ModuleType

import torch

from worker.attention.fp8_kv import is_fp8
from worker.attention.metadata import AttentionMetadata

_KERNELS_MODULE = "worker.attention.triton_kernels"
_SPLIT_KERNELS_MODULE = "worker.attention.triton_split_kernels"
_MIN_DOT_SIZE = 16  # tl.dot needs every dimension >= 16 on GPUs


def _next_power_of_2(n: int) -> int:
    return 1 << max(n - 1, 0).bit_length()


def _dot_size(n: int) -> int:
    return max(_MIN_DOT_SIZE, _next_power_of_2(n))


def _load_kernels(name: str = _KERNELS_MODULE) -> ModuleType:
    try:
        return importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != "triton" and not (exc.name or "").startswith("triton."):
            raise
        raise RuntimeError(
            "The triton attention backend needs the 'triton' package "
            "(pip install 'pagedserve[triton]'); use the torch backend otherwise."
        ) from exc


def _last_dim_contiguous(tensor: torch.Tensor) -> torch.Tensor:
    # The kernels index the head dimension with unit stride; other strides are passed in.
    return tensor if tensor.stride(-1) == 1 else tensor.contiguous()


class TritonAttentionBackend:
    """AttentionBackend: write new K/V into the paged cache, then attend.

    Decode sequences (the leading `meta.num_decodes`) run one program per
    (sequence, kv head), or, when the block table can hold more than
    `partition_size` tokens, one per (sequence, kv head, partition) plus a
    reduce (split-K, worker.attention.triton_split_kernels); prefill/extend
    chunks run one program per (sequence, kv head, tile of query tokens).
    `block_m` is the rows per prefill tile (query tokens x query heads of one
    kv head), `block_n` the keys per tile; both powers of two >= 16.
    `partition_size` is a power-of-two multiple of block_n.

    CUDA-graph safe decode (always, no flag): a step whose sequences are all
    decodes launches kernels whose grids depend only on num_decodes, the head
    counts, head_dim, block_size and block_tables.shape[1]; seq lens, block
    tables and query starts are read on the device only, nothing syncs to the
    host, and the cache write skips slot_mapping < 0 (padding rows; give them
    seq_len 0). A graph runner keeps block_tables one fixed width, e.g.
    cdiv(max_model_len, block_size), so the partition count is fixed too.
    """

    name = "triton"
    supports_softcap = True
    graph_safe_decode = True  # see above: what a CUDA-graph runner may rely on

    def __init__(self, block_m: int = 64, block_n: int = 32, num_warps: int = 4,
                 partition_size: int = 512) -> None:
        for label, size in (("block_m", block_m), ("block_n", block_n)):
            if size < _MIN_DOT_SIZE or size & (size - 1):
                raise ValueError(f"{label} must be a power of two >= {_MIN_DOT_SIZE}, got {size}")
        if partition_size < block_n or partition_size & (partition_size - 1):
            raise ValueError(f"partition_size must be a power of two >= block_n ({block_n}), got {partition_size}")
        self.block_m = block_m
        self.block_n = block_n
        self.num_warps = num_warps
        self.partition_size = partition_size
        self._kernels = _load_kernels()
        self._split_kernels = _load_kernels(_SPLIT_KERNELS_MODULE)

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        meta: AttentionMetadata,
        *,
        scale: float,
        sliding_window: int | None = None,
        k_scale: float = 1.0,
        v_scale: float = 1.0,
        softcap: float | None = None,
    ) -> torch.Tensor:
        """k_scale/v_scale: an 8-bit cache's per-tensor scales (worker.attention.fp8_kv);
        softcap: scores capped to tanh(s / softcap) * softcap before the softmax (None: not)."""
        self._check_inputs(query, key, value, k_cache, v_cache)
        query, key, value = (_last_dim_contiguous(t) for t in (query, key, value))
        output = torch.empty_like(query)
        if query.shape[0] == 0:
            return output
        self._write_kv_cache(key, value, k_cache, v_cache, meta, k_scale, v_scale)
        window = sliding_window if sliding_window and sliding_window > 0 else self._kernels.NO_WINDOW
        scales = (scale * k_scale, v_scale)  # the K scale scales every score; the V scale the output
        cap = float(softcap or 0.0)
        if meta.num_decodes > 0:
            self._decode(output, query, k_cache, v_cache, meta, scales, window, cap)
        if meta.num_seqs > meta.num_decodes:
            self._prefill(output, query, k_cache, v_cache, meta, scales, window, cap)
        return output

    def _check_inputs(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                      k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
        num_heads, head_dim = query.shape[1], query.shape[2]
        num_kv_heads = k_cache.shape[2]
        if key.shape != value.shape or key.shape[1:] != (num_kv_heads, head_dim):
            raise ValueError(f"key/value shape {tuple(key.shape)} does not match cache {tuple(k_cache.shape)}")
        if k_cache.shape != v_cache.shape or k_cache.stride() != v_cache.stride() or k_cache.stride(-1) != 1:
            raise ValueError("k_cache and v_cache must have equal shapes and strides, head_dim contiguous")
        if k_cache.dtype != v_cache.dtype:
            raise ValueError(f"k_cache dtype {k_cache.dtype} differs from v_cache dtype {v_cache.dtype}")
        if num_heads % num_kv_heads:
            raise ValueError(f"{num_heads} query heads are not a multiple of {num_kv_heads} kv heads")
        if query.device.type == "cpu" and not self._kernels.RUNS_INTERPRETED:
            raise RuntimeError("triton kernels on CPU tensors need TRITON_INTERPRET=1 set before "
                               f"{_KERNELS_MODULE} is imported")

    def _write_kv_cache(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                        v_cache: torch.Tensor, meta: AttentionMetadata, k_scale: float, v_scale: float) -> None:
        num_kv_heads, head_dim = key.shape[1], key.shape[2]
        fp8 = is_fp8(k_cache.dtype)
        self._kernels.write_kv_cache_kernel[(key.shape[0],)](
            key, value, k_cache, v_cache, meta.slot_mapping,
            key.stride(0), key.stride(1), value.stride(0), value.stride(1),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            k_cache.shape[1], num_kv_heads, head_dim, float(k_scale), float(v_scale),
            KV_HEADS_PAD=_next_power_of_2(num_kv_heads), HEAD_DIM_PAD=_next_power_of_2(head_dim),
            KV_FP8=fp8, FP8_MAX=float(torch.finfo(k_cache.dtype).max) if fp8 else 0.0,
            FP8_MANTISSA=3 if k_cache.dtype == torch.float8_e4m3fn else 2,
            FP8_BIAS=7 if k_cache.dtype == torch.float8_e4m3fn else 15,
            num_warps=self.num_warps,
        )

    def _common_args(self, output: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                     v_cache: torch.Tensor, meta: AttentionMetadata) -> tuple:
        return (
            output, query, k_cache, v_cache, meta.block_tables, meta.seq_lens, meta.query_start_loc,
            query.stride(0), query.stride(1), output.stride(0), output.stride(1), meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        )

    def decode_partitions(self, meta: AttentionMetadata, block_size: int) -> int:
        """Partitions a decode launch covers: from the block table's width (a shape, fixed
        under CUDA graphs), never from this step's lengths; 1 means the unsplit kernel."""
        return -(-meta.block_tables.shape[1] * block_size // self.partition_size)

    def _decode(self, output: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                v_cache: torch.Tensor, meta: AttentionMetadata, scales: tuple[float, float], window: int,
                softcap: float) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        num_heads = query.shape[1]
        queries_per_kv = num_heads // num_kv_heads
        block_size = k_cache.shape[1]
        num_partitions = self.decode_partitions(meta, block_size)
        tiles = dict(GROUP_PAD=_dot_size(queries_per_kv), HEAD_DIM_PAD=_dot_size(head_dim), BLOCK_N=self.block_n,
                     UPCAST_DOT=self._kernels.RUNS_INTERPRETED, KV_FP8=is_fp8(k_cache.dtype),
                     USE_SOFTCAP=softcap > 0, num_warps=self.num_warps)
        if num_partitions <= 1:
            self._kernels.paged_decode_kernel[(meta.num_decodes, num_kv_heads)](
                *self._common_args(output, query, k_cache, v_cache, meta),
                float(scales[0]), window, block_size, queries_per_kv, head_dim, float(scales[1]), softcap, **tiles)
            return
        rows = (meta.num_decodes, num_heads, num_partitions)
        part_out = torch.empty(*rows, tiles["HEAD_DIM_PAD"], dtype=torch.float32, device=query.device)
        part_max = torch.empty(rows, dtype=torch.float32, device=query.device)
        part_sum = torch.empty(rows, dtype=torch.float32, device=query.device)
        self._split_kernels.paged_decode_split_kernel[(meta.num_decodes, num_kv_heads, num_partitions)](
            part_out, part_max, part_sum, query, k_cache, v_cache, meta.block_tables, meta.seq_lens,
            meta.query_start_loc, query.stride(0), query.stride(1), meta.block_tables.stride(0),
            k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
            float(scales[0]), window, block_size, queries_per_kv, head_dim, softcap, num_heads, num_partitions,
            PARTITION_SIZE=self.partition_size, **tiles)
        self._split_kernels.paged_decode_reduce_kernel[(meta.num_decodes, num_heads)](
            output, part_out, part_max, part_sum, meta.seq_lens, meta.query_start_loc,
            output.stride(0), output.stride(1), window, head_dim, float(scales[1]), num_heads, num_partitions,
            HEAD_DIM_PAD=tiles["HEAD_DIM_PAD"], PARTITION_SIZE=self.partition_size, num_warps=self.num_warps)

    def _prefill(self, output: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor, meta: AttentionMetadata, scales: tuple[float, float], window: int,
                 softcap: float) -> None:
        num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
        queries_per_kv = query.shape[1] // num_kv_heads
        block_m = max(self.block_m, _dot_size(queries_per_kv))
        block_q = block_m // queries_per_kv  # query tokens per tile
        starts = meta.query_start_loc_cpu
        max_query_len = max(starts[i + 1] - starts[i] for i in range(meta.num_decodes, meta.num_seqs))
        grid = (meta.num_seqs - meta.num_decodes, num_kv_heads, -(-max_query_len // block_q))
        self._kernels.paged_prefill_kernel[grid](
            *self._common_args(output, query, k_cache, v_cache, meta),
            float(scales[0]), window, k_cache.shape[1], queries_per_kv, head_dim, meta.num_decodes, float(scales[1]),
            softcap, BLOCK_Q=block_q, BLOCK_M=block_m, HEAD_DIM_PAD=_dot_size(head_dim), BLOCK_N=self.block_n,
            UPCAST_DOT=self._kernels.RUNS_INTERPRETED, KV_FP8=is_fp8(k_cache.dtype), USE_SOFTCAP=softcap > 0,
            num_warps=self.num_warps,
        )
