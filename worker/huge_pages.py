"""Zeroed CPU tensors on transparent huge pages.

Decode attention reads KV blocks scattered over gigabytes of cache; with 4 KiB
pages nearly every block costs TLB misses, and the hardware prefetcher stops
at each page edge. Most kernels run THP in `madvise` mode, so the cache asks
for huge pages itself: a 2 MiB-aligned slice of a slightly larger buffer,
advised before it is first touched. Where that is not possible (not Linux,
THP off) the tensor is an ordinary one.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import logging
import sys

import torch

logger = logging.getLogger(__name__)

HUGE_PAGE = 2 * 1024 * 1024
MADV_HUGEPAGE = 14  # <sys/mman.h> on Linux


def _madvise_huge(address: int, length: int) -> bool:
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
        return libc.madvise(ctypes.c_void_p(address), ctypes.c_size_t(length), MADV_HUGEPAGE) == 0
    except (OSError, AttributeError):
        return False


def zeros_on_huge_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.zeros(shape, dtype) on the CPU, backed by huge pages when the OS allows."""
    numel = 1
    for size in shape:
        numel *= size
    nbytes = numel * torch.empty((), dtype=dtype).element_size()
    if not sys.platform.startswith("linux") or nbytes < HUGE_PAGE:
        return torch.zeros(shape, dtype=dtype)
    raw = torch.empty(nbytes + HUGE_PAGE, dtype=torch.uint8)  # untouched: no page is backed yet
    start = (-raw.data_ptr()) % HUGE_PAGE
    if not _madvise_huge(raw.data_ptr() + start, nbytes // HUGE_PAGE * HUGE_PAGE):
        logger.debug("madvise(MADV_HUGEPAGE) refused; the KV cache uses normal pages")
    # The view keeps `raw`'s storage alive; zeroing it is the first touch, which maps huge pages.
    return raw[start:start + nbytes].view(dtype).view(shape).zero_()
