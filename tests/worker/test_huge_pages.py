"""The KV cache's huge-page allocation: an ordinary zeroed tensor to every caller."""
from __future__ import annotations

import torch

from worker.huge_pages import HUGE_PAGE, zeros_on_huge_pages
from worker.kv_cache import allocate_kv_caches
from tiny_models import TINY_SIZES


def test_zeros_on_huge_pages_is_a_zeroed_aligned_writable_tensor():
    t = zeros_on_huge_pages((300, 16, 3, 64), torch.bfloat16)  # 1.8 MiB: below one huge page
    assert t.shape == (300, 16, 3, 64) and t.dtype == torch.bfloat16 and t.is_contiguous()
    assert not t.any()
    big = zeros_on_huge_pages((3000, 16, 3, 64), torch.bfloat16)
    assert big.data_ptr() % HUGE_PAGE == 0 and big.is_contiguous() and not big.any()
    big[-1, -1, -1, -1] = 2.5
    assert big.flatten()[-1].item() == 2.5 and big.sum().item() == 2.5


def test_kv_caches_are_zeroed_and_separate():
    import transformers

    caches = allocate_kv_caches(transformers.LlamaConfig(**TINY_SIZES), num_blocks=4096, block_size=16, dtype=torch.float32,
                                device="cpu")
    k0, v0 = caches[0]
    assert not k0.any() and not v0.any()
    k0.fill_(1.0)
    assert not v0.any() and not caches[-1][0].any()


def _pages_resident(tensor: torch.Tensor) -> bool:
    """mincore(2): whether every page under the tensor is mapped in memory now."""
    import ctypes
    import ctypes.util
    import mmap

    libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
    start = tensor.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = tensor.data_ptr() + tensor.numel() * tensor.element_size() - start
    vector = (ctypes.c_ubyte * -(-length // mmap.PAGESIZE))()
    assert libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vector) == 0, ctypes.get_errno()
    return all(byte & 1 for byte in vector)


def test_every_page_is_mapped_up_front_and_outlives_the_function_that_made_it():
    import gc

    cache = zeros_on_huge_pages((64, 1024, 1024), torch.uint8)  # 64 MiB, never written here
    assert _pages_resident(cache)  # serving will not wait on page faults
    gc.collect()  # the mapping lives as long as the tensor
    cache[-1, -1, -1] = 7
    assert cache.sum().item() == 7
