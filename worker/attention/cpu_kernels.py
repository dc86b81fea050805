"""The CPU kernels (paged attention, the K/V cache write, the greedy near-tie scan,
random sampling, sampled tokens' logprobs, the rotary embedding, the packed bfloat16 and
float32 matmuls, their SiLU-gated versions and the screened greedy lm_head): one C++ extension built from `cpu_attention_source`,
`worker.cpu_scan_source`, `worker.cpu_sampling_source`, `worker.cpu_logprobs_source`,
`worker.cpu_activation_source`, `worker.cpu_rotary_source`,
`worker.cpu_linear_source`, `worker.cpu_argmax_source`, `worker.cpu_bf16_screen_source` and
`worker.cpu_bf16_screen_entry_source` with the local C++ compiler at first use, cached on
disk, and optional.

The build (about a minute, once per machine and source version) goes to
torch's extension cache (`TORCH_EXTENSIONS_DIR`, default
~/.cache/torch_extensions). The cache name carries a digest of the source,
the flags and this CPU's feature flags, because `-march=native` code must
never be loaded on a different CPU. Any failure (no compiler, no headers, a
compile error) is logged once and the caller falls back to plain PyTorch;
`PAGEDSERVE_CPU_KERNELS=0` skips the kernel altogether.
"""
from __future__ import annotations

import contextlib
import fcntl
import hashlib
import logging
import os
import threading
from collections.abc import Iterator
from typing import Any

import torch

from worker.attention.cpu_attention_source import FUNCTIONS as ATTENTION_FUNCTIONS
from worker.attention.cpu_attention_source import SOURCE as ATTENTION_SOURCE
from worker.cpu_activation_source import ACTIVATION_SOURCE
from worker.cpu_linear_source import LINEAR_SOURCE
from worker.cpu_logprobs_source import LOGPROBS_SOURCE
from worker.cpu_rotary_source import ROTARY_SOURCE
from worker.cpu_argmax_source import ARGMAX_SOURCE
from worker.cpu_bf16_screen_source import BF16_SCREEN_SOURCE
from worker.cpu_bf16_screen_entry_source import BF16_SCREEN_ENTRY_SOURCE
from worker.cpu_sampling_source import SAMPLING_SOURCE
from worker.cpu_scan_source import SCAN_SOURCE

SOURCE = (ATTENTION_SOURCE + SCAN_SOURCE + SAMPLING_SOURCE + LOGPROBS_SOURCE + ACTIVATION_SOURCE + ROTARY_SOURCE
          + LINEAR_SOURCE + ARGMAX_SOURCE + BF16_SCREEN_SOURCE + BF16_SCREEN_ENTRY_SOURCE)
FUNCTIONS = [*ATTENTION_FUNCTIONS, "near_top_scan", "sample_random_rows", "token_logprobs_rows",
             "bf16_linear_available", "f32_linear_available", "screened_argmax", "screened_argmax_available",
             "screened_bf16_argmax", "bf16_screen_bounds", "bf16_screen_available"]

logger = logging.getLogger(__name__)

ENV_SWITCH = "PAGEDSERVE_CPU_KERNELS"
# -fopenmp makes at::parallel_for (inline in ATen's headers) parallel; the extension's
# libgomp.so.1 resolves to the copy torch already loaded, so there is one thread pool.
CFLAGS = ["-O3", "-march=native", "-fopenmp", "-ffast-math", "-fno-finite-math-only"]
LDFLAGS = ["-fopenmp"]
GUARD_FILE = "pagedserve-build.flock"

_lock = threading.Lock()
_module: Any = None
_failed = False


def _cpu_flags() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return ""


def _extension_name() -> str:
    digest = hashlib.sha256("\n".join([SOURCE, " ".join(CFLAGS + LDFLAGS), _cpu_flags(), torch.__version__]).encode())
    return f"pagedserve_cpu_kernels_{digest.hexdigest()[:12]}"


@contextlib.contextmanager
def _exclusive_build(name: str) -> Iterator[str]:
    """Hold the build directory against other processes, with a lock the kernel drops when its holder dies.

    torch's own lock is a file: a build killed midway (a worker restarted during
    its first start) leaves it behind, and every later load then waits for it
    forever. Every build here takes this flock first, so while we hold it
    torch's lock file can only be a dead build's, and is removed.
    """
    from torch.utils.cpp_extension import _get_build_directory
    build_dir = _get_build_directory(name, verbose=False)
    os.makedirs(build_dir, exist_ok=True)
    with open(os.path.join(build_dir, GUARD_FILE), "a") as guard:
        try:
            fcntl.flock(guard, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            logger.info("Waiting for another process that is building the CPU kernels...")
            fcntl.flock(guard, fcntl.LOCK_EX)
        torch_lock = os.path.join(build_dir, "lock")
        if os.path.exists(torch_lock):
            logger.warning("removing the lock file of a kernel build that was killed midway: %s", torch_lock)
            with contextlib.suppress(OSError):
                os.remove(torch_lock)
        yield build_dir


def enabled() -> bool:
    return os.environ.get(ENV_SWITCH, "1").lower() not in ("0", "false", "no", "off")


def load() -> Any | None:
    """The compiled extension module, or None when it is disabled or cannot be built."""
    global _module, _failed
    if _module is not None or _failed:
        return _module
    with _lock:
        if _module is not None or _failed:
            return _module
        if not enabled():
            _failed = True
            return None
        try:
            from torch.utils.cpp_extension import load_inline
            name = _extension_name()
            with _exclusive_build(name) as build_dir:
                if not os.path.exists(os.path.join(build_dir, f"{name}.so")):  # else torch only loads it
                    logger.info("Building the CPU kernels (first use on this machine)...")
                _module = load_inline(name=name, cpp_sources=[SOURCE], functions=FUNCTIONS,
                                      extra_cflags=CFLAGS, extra_ldflags=LDFLAGS, verbose=False)
            # Loading the library defined these operators; compiled graphs trace them with their fakes.
            torch.library.register_fake("pagedserve::packed_linear")(_packed_linear_shape)
            torch.library.register_fake("pagedserve::packed_linear_silu")(_packed_linear_shape)
            torch.library.register_fake("pagedserve::rotary_qk")(_rotary_qk_shapes)
        except Exception as exc:  # no compiler, headers or a build error: plain PyTorch still works
            _failed = True
            logger.warning("CPU paged attention kernel unavailable, using the PyTorch fallback: %s",
                           str(exc).strip().splitlines()[-1] if str(exc).strip() else type(exc).__name__)
    return _module


def _rotary_qk_shapes(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
                      kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    tokens, dim = qkv.shape[0], cos.shape[-1]
    return qkv.new_empty((tokens, heads, dim)), qkv.new_empty((tokens, kv_heads, dim))


def _packed_linear_shape(x: torch.Tensor, packed: torch.Tensor, out_features: int,
                       bias: torch.Tensor | None) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def packed_linear_available(dtype: torch.dtype) -> bool:
    """Whether the extension is built and this CPU runs its packed matmul in `dtype`:
    bfloat16 needs AVX512-BF16, float32 AVX-512."""
    if load() is None:
        return False
    if dtype == torch.bfloat16:
        return bool(_module.bf16_linear_available())
    return dtype == torch.float32 and bool(_module.f32_linear_available())


def paged_attention(out: torch.Tensor, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                    block_tables: torch.Tensor, query_start_loc: torch.Tensor, seq_lens: torch.Tensor,
                    scale: float, sliding_window: int | None) -> None:
    """Fill `out` [T, H, D] with attention over the paged cache for every sequence of the batch.
    Requires `load()` to have succeeded; all tensors on CPU, int32 metadata."""
    _module.paged_attention(out, query, k_cache, v_cache, block_tables, query_start_loc, seq_lens,
                            float(scale), int(sliding_window or 0))


def write_kv_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                   slot_mapping: torch.Tensor) -> None:
    """Copy the new tokens' K/V [T, KVH, D] (rows contiguous; the caches' dtype, or float32 rounded
    into bfloat16 caches) into their slots of the [blocks, block_size, KVH, D] caches. Requires
    `load()` to have succeeded."""
    _module.write_kv_cache(key, value, k_cache, v_cache, slot_mapping)


def near_top_scan(logits: torch.Tensor, model_dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """`worker.greedy_refine.near_top_scan` for contiguous float32/bfloat16 CPU logits
    [N, vocab]: (argmax [N], near-top counts [N]). Requires `load()` to have succeeded."""
    info = torch.finfo(model_dtype)
    argmax, counts = _module.near_top_scan(logits, float(info.eps), float(info.tiny))
    return argmax, counts


def sample_random_rows(logits: torch.Tensor, temperature: torch.Tensor, top_k: torch.Tensor, top_p: torch.Tensor,
                       min_p: torch.Tensor, keys: torch.Tensor) -> torch.Tensor:
    """`worker.random_race.sample_random_rows_reference` for contiguous float32/bfloat16 CPU
    logits [R, vocab]; every parameter a contiguous [R] column (top_k int64, 0: off; top_p
    float32, 1: off; min_p float32, 0: off; keys int64). Requires `load()` to have succeeded."""
    return _module.sample_random_rows(logits, temperature, top_k, top_p, min_p, keys)


def token_logprobs_rows(logits: torch.Tensor, chosen: torch.Tensor,
                       num_top: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """For contiguous float32/bfloat16 CPU logits [R, vocab] and chosen ids [R] (int64):
    the chosen logprobs [R], their ranks [R], and the `num_top` largest logprobs [R, num_top]
    with their ids (see worker.cpu_logprobs_source). Requires `load()` to have succeeded."""
    chosen_logprobs, ranks, top_logprobs, top_ids = _module.token_logprobs_rows(logits, chosen, int(num_top))
    return chosen_logprobs, ranks, top_logprobs, top_ids


def rotary_qk(qkv: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, heads: int,
              kv_heads: int) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, heads, D] and k [T, kv_heads, D], rotated and contiguous, from a fused bf16 qkv
    projection [T, >= (heads + kv_heads) * D] (q's heads first, then k's) and cos/sin [T, D]:
    bit for bit `worker.models.rotary.apply_rotary` in eager bf16 (see
    worker.cpu_rotary_source). Requires `load()` to have succeeded."""
    return torch.ops.pagedserve.rotary_qk(qkv, cos, sin, heads, kv_heads)
